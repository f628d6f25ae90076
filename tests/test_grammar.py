"""One grammar for every command: the global options anywhere, --json everywhere, revert's
--dry-run, -o, and Ctrl-C (exit 130, nothing half-written)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.cli import cli
from tests.cli import document, invoke, kvprep
from tests.safety_kit import journal_data, prepare, save_journal
from tests.treesnap import snapshot

QWEN_7B = Path(__file__).parent / "data" / "qwen-7b-chat-config"


@pytest.fixture()
def modules_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    # not the cache fix used: revert must name the recorded one
    monkeypatch.setenv("QWEN_KVPREP_CACHE", str(tmp_path / "default-cache"))
    return dict(os.environ)


# -- the global options ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_every_command_takes_json_and_debug(name: str) -> None:
    res = invoke(name, "--help")
    assert res.returncode == 0, res.stderr
    assert "--json" in res.stdout and "--debug" in res.stdout, name


def test_global_options_before_or_after_the_command() -> None:
    for args in (("--json", "plan", str(QWEN_7B), "--gpu", "h100"),
                 ("plan", str(QWEN_7B), "--gpu", "h100", "--json")):
        res = invoke(*args)
        assert res.returncode == 0, (args, res.stderr)
        assert document(res)["plan"]["model"]["layers"] == 32
    bad = ("plan", str(QWEN_7B), "--gpu-memory", "24")
    for args in (("--debug", *bad), (*bad, "--debug")):
        res = kvprep(*args)
        assert res.returncode == 1 and "Traceback" in res.stderr, args  # --debug re-raises
    res = kvprep(*bad)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    for args in (("--json", *bad), (*bad, "--json")):
        res = kvprep(*args)
        assert res.returncode == 2 and document(res)["ok"] is False, args


# -- revert: --dry-run, --json and the build cache fix used -----------------------------------


def test_revert_dry_run_changes_nothing_and_names_the_recorded_cache(
    tmp_path: Path, modules_env: dict[str, str]
) -> None:
    p = prepare(tmp_path, build=True)
    recorded = tmp_path / "cache"  # fake_build's <cache>/builds/k1
    before_dir, before_modules = snapshot(p.directory), snapshot(p.modules)
    res = kvprep("revert", "--dry-run", str(p.directory), env=modules_env)
    assert res.returncode == 0, res.stderr
    assert "would restore 7 file(s)" in res.stdout and "config.json" in res.stdout
    assert f"the build cache fix used, {recorded}," in res.stdout
    assert "default-cache" not in res.stdout
    assert snapshot(p.directory) == before_dir and snapshot(p.modules) == before_modules
    doc = document(kvprep("revert", str(p.directory), "--dry-run", "--json", env=modules_env))
    assert doc["revert"]["dry_run"] is True and "config.json" in doc["revert"]["restored"]
    assert doc["revert"]["build_cache"] == str(recorded)
    assert snapshot(p.directory) == before_dir  # no lock file either

    res = kvprep("revert", str(p.directory), "--json", env=modules_env)
    assert res.returncode == 0, res.stderr
    doc = document(res)
    assert doc["ok"] is True and doc["revert"]["dry_run"] is False
    assert doc["revert"]["build_cache"] == str(recorded)
    assert len(doc["revert"]["restored"]) == 7
    assert snapshot(p.directory) == p.pristine
    assert recorded.is_dir()  # shared between checkpoints: kept
    doc = document(kvprep("revert", str(p.directory), "--json", env=modules_env))
    assert doc["revert"]["restored"] == [] and doc["revert"]["build_cache"] is None


def test_revert_dry_run_refuses_what_revert_would(
    tmp_path: Path, modules_env: dict[str, str]
) -> None:
    p = prepare(tmp_path)
    shutil.rmtree(p.directory / ".qwen-kvprep" / "originals")
    before = snapshot(p.directory)
    res = kvprep("revert", str(p.directory), "--dry-run", env=modules_env)
    assert res.returncode == 1 and "would be refused" in res.stderr
    assert "Traceback" not in res.stderr
    assert snapshot(p.directory) == before
    # a damaged journal: refused as revert refuses it
    data: Any = journal_data(p.directory)
    data["files"]["config.json"]["store"] = "originals/../../../outside/victim.txt"
    save_journal(p.directory, data)
    before = snapshot(p.directory)
    res = kvprep("revert", str(p.directory), "--dry-run", "--json", env=modules_env)
    assert res.returncode == 1 and document(res)["ok"] is False
    assert snapshot(p.directory) == before


# -- -o is the same option everywhere ----------------------------------------------------------


def test_o_is_output_in_every_command_that_writes(tmp_path: Path) -> None:
    for name in ("fix", "prestart", "template"):
        assert "-o, --output" in invoke(name, "--help").stdout, name
    for spelling in ("-o", "--output"):
        out = tmp_path / f"entrypoint{spelling}.sh"
        res = invoke("template", "entrypoint", spelling, str(out))
        assert res.returncode == 0 and out.read_text().startswith("#!/bin/sh")
    out = tmp_path / "old.sh"
    res = invoke("template", "entrypoint", "--out-file", str(out))
    assert res.returncode == 0 and out.is_file()
    assert "--out-file is deprecated" in res.stderr
    doc = document(invoke("template", "k8s", "--json"))
    assert doc["template"]["kind"] == "k8s" and "Deployment" in doc["template"]["text"]


# -- Ctrl-C -------------------------------------------------------------------------------------


def _interrupt_at_the_second_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """KeyboardInterrupt inside a write (its temporary file written, not yet renamed)."""
    real = os.fsync
    calls = {"n": 0}

    def fsync(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _temporaries(*folders: Path) -> list[Path]:
    return [f for d in folders for f in d.rglob("*") if f.name.endswith((".tmp", ".lnk"))]


def test_ctrl_c_in_a_write_exits_130_and_leaves_nothing_half_written(
    tmp_path: Path, modules_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    p = prepare(tmp_path)
    _interrupt_at_the_second_fsync(monkeypatch)
    res = invoke("revert", str(p.directory))
    monkeypatch.undo()
    assert res.returncode == 130, res.stderr
    assert "Aborted" not in res.stderr and "Traceback" not in res.stderr
    assert not _temporaries(p.directory, p.modules)
    config = json.loads((p.directory / "config.json").read_text())  # whole, either version
    assert config["model_type"] == "qwen"
    # the journal is still there: running revert again finishes the job, exactly
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    res = kvprep("revert", str(p.directory), env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    assert snapshot(p.directory) == p.pristine


# Ctrl-C at the command's Nth durable write, counted in the main thread only: the command's
# own threads (a progress heartbeat, a lock's waiting notice) also write, earlier or later
# with the machine's load, and a signal raised from one of them lands wherever the main
# thread happens to be. Raised by the main thread itself, Python delivers it before the
# write returns: the same point of the command on every run.
# Python keeps SIGINT ignored when it starts with it ignored, as every command started in
# the background by a shell without job control does (`bash .ci/run &`): Python's own
# handler first, as a terminal's Python has it.
_SIGINT_CHILD = """
import os, signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)
real = os.fsync
calls = [0]
def fsync(fd):
    if threading.current_thread() is threading.main_thread():
        calls[0] += 1
        if calls[0] == 2:
            signal.raise_signal(signal.SIGINT)  # as a terminal's Ctrl-C would
    real(fd)
os.fsync = fsync
from qwen_kvprep.entry import main
main(sys.argv[1:])
"""


def test_sigint_to_a_running_command_exits_130(
    tmp_path: Path, modules_env: dict[str, str]
) -> None:
    p = prepare(tmp_path)
    res = subprocess.run([sys.executable, "-c", _SIGINT_CHILD, "revert", str(p.directory)],
                         capture_output=True, text=True, timeout=120, env=modules_env)
    assert res.returncode == 130, res.stderr
    assert "Aborted" not in res.stderr and "Traceback" not in res.stderr
    assert "interrupted" in res.stderr
    assert not _temporaries(p.directory, p.modules)
    assert kvprep("revert", str(p.directory), env=modules_env).returncode == 0
    assert snapshot(p.directory) == p.pristine
    assert signal.SIGINT == 2  # 130 = 128 + SIGINT


def test_sigint_during_fix_leaves_a_folder_fix_or_revert_finishes(
    tmp_path: Path, isolated_hf: Path
) -> None:
    from qwen_kvprep.tiny import generate_checkpoint

    model = generate_checkpoint(tmp_path / "tiny", layers=1, shards=1)
    pristine = snapshot(model)
    child = _SIGINT_CHILD.replace("calls[0] == 2", "calls[0] == 3")  # a few files in
    res = subprocess.run(
        [sys.executable, "-c", child, "fix", str(model), "--no-build", "--no-smoke"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert res.returncode == 130, res.stderr
    assert "Aborted" not in res.stderr and "Traceback" not in res.stderr
    assert not _temporaries(model)
    json.loads((model / "config.json").read_text())  # whole
    res = kvprep("fix", str(model), "--no-build", "--no-smoke")  # finishes the job
    assert res.returncode == 0, res.stderr
    assert json.loads((model / "config.json").read_text())["use_cache_kernel"] is True
    res = kvprep("revert", str(model))
    assert res.returncode == 0, res.stderr
    assert snapshot(model) == pristine


def test_json_means_one_document_in_every_mode_of_doctor() -> None:
    doc = document(kvprep("doctor", "--list-checks", "--json"))
    assert {"id", "title"} == set(doc["checks"][0]) and len(doc["checks"]) > 20
    doc = document(kvprep("doctor", "--report", "--json", "--check", "env.python"))
    assert doc["report"].startswith("### qwen-kvprep report")
    assert [f["id"] for f in doc["findings"]] == ["env.python"]
