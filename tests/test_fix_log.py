"""`fix` in a log (stderr not a terminal: CI, `docker build`, an init container): a line a
step with the time since the start, a heartbeat while a build or a model load runs, the
build log named where it stays; and a second `fix` on an unchanged checkpoint that writes
nothing and loads nothing (`--smoke` runs the smoke anyway)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.buildcache import builder
from qwen_kvprep.smoke import progress
from tests.cli import document, invoke, kvprep
from tests.treesnap import snapshot

LINE = re.compile(r"^\[ *\d+\.\ds\] fix: (.*)$")


def _log_lines(stderr: str) -> list[str]:
    return [m.group(1) for m in map(LINE.match, stderr.splitlines()) if m]


@pytest.fixture()
def slow_fake_worker(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The compiler process replaced by one that takes `seconds` and writes a .so."""
    seen: dict[str, Any] = {"seconds": 1.6}

    def run(spec_path: Path, log: Any, env: dict[str, str], cwd: Path) -> None:
        spec = json.loads(spec_path.read_text())
        log.write(b"fake compiler output\n")
        time.sleep(seen["seconds"])
        so = Path(spec["build_directory"]) / f"{spec['name']}.so"
        so.write_bytes(b"\x7fELF fake extension " + os.urandom(8))
        Path(spec["result"]).write_text(json.dumps({"ok": True, "so": str(so)}))

    monkeypatch.setattr(builder, "_run_worker", run)
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.5)
    return seen


def test_piped_build_beats_while_compiling(
    isolated_hf: Path, tmp_path: Path, slow_fake_worker: dict[str, Any]
) -> None:
    """`qwen-kvprep build` is what an image build runs: it must not be silent either."""
    cache = tmp_path / "cache"  # never the shared cache: this build is a fake
    res = invoke("build", "--cache-dir", str(cache), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = document(res)  # the log went to stderr
    said = [m.group(1) for m in map(re.compile(r"^\[ *\d+\.\ds\] build: (.*)$").match,
                                    res.stderr.splitlines()) if m]
    assert said[0] == "looking up the extension in the build cache ...", said
    assert any(s.startswith("compiling the extension") for s in said), said
    assert len([s for s in said if s.startswith("still compiling the extension (")]) >= 2, said
    assert (Path(doc["build"]["dir"]) / "build.log").is_file()

def test_piped_fix_logs_each_step_and_beats_while_compiling(
    isolated_hf: Path, tmp_path: Path, slow_fake_worker: dict[str, Any]
) -> None:
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "tiny")
    cache = tmp_path / "cache"  # never the shared cache: this build is a fake
    res = invoke("fix", str(ckpt), "--no-smoke", "--json", "--cache-dir", str(cache))
    assert res.returncode == 0, res.stdout + res.stderr
    doc = document(res)  # stdout holds the document alone; the log went to stderr
    said = _log_lines(res.stderr)
    assert said[0] == "checking the checkpoint ..."
    for step in ("looking up the extension in the build cache ...", "installing the loader ...",
                 "recording the state ..."):
        assert step in said, said
    assert not any(s.startswith("smoke") for s in said)  # --no-smoke
    compiling = next(s for s in said if s.startswith("compiling the extension"))
    beats = [s for s in said if s.startswith("still compiling the extension (")]
    assert len(beats) >= 2, res.stderr  # 1.6 s of compiling, a heartbeat each 0.5 s
    # the log is named where it stays once the staging folder is gone, and is there
    build_dir = Path(doc["build"]["dir"])
    kept = build_dir / "build.log"
    assert f"kept as {kept}" in compiling and kept.is_file()
    assert "fake compiler output" in kept.read_text()
    found = {f["id"]: f for f in doc["findings"]}["build.build"]
    assert f"log: {kept}" in found["message"]
    # the verdict, as new fields only: nothing proved the result yet
    assert doc["verdict"] == "unproven" and doc["next"].startswith("qwen-kvprep smoke ")
    # the elapsed times grow and the last line is not before the compile's length
    times = [float(line.split("s]")[0].strip("[ ")) for line in res.stderr.splitlines()
             if LINE.match(line)]
    assert times == sorted(times) and times[-1] >= slow_fake_worker["seconds"]


def test_heartbeat_only_in_silence() -> None:
    """A line a phase, then `still …` once nothing was said for the heartbeat's length."""
    import io

    stream = io.StringIO()
    with progress.StepLog(stream, heartbeat=0.3) as log:
        log.phase("loading")
        time.sleep(0.05)
        log.note("a note")  # resets the silence
        time.sleep(0.9)
    lines = _log_lines(stream.getvalue())
    assert lines[:2] == ["loading ...", "a note"]
    assert lines[2].startswith("still loading (") and len(lines) >= 3
    # nothing after close
    count = len(stream.getvalue().splitlines())
    time.sleep(0.5)
    assert len(stream.getvalue().splitlines()) == count


def test_no_log_on_a_terminal() -> None:
    class Tty:
        def isatty(self) -> bool:
            return True

    assert progress.step_log(stream=Tty()) is None  # type: ignore[arg-type]


def test_smoke_and_no_smoke_contradict(tmp_path: Path) -> None:
    res = invoke("fix", str(tmp_path), "--smoke", "--no-smoke")
    assert res.returncode == 2 and "contradict" in res.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- a second fix, a no-op


def _trees(*roots: Path) -> dict[str, Any]:
    """Every file's bytes and mtime, but a lock file's mtime: filelock 3 (all that Python 3.9
    has) opens its file with O_TRUNC, which stamps even an empty one."""
    return {
        str(r): {
            rel: entry[:-1] if Path(rel).name.endswith("lock") and entry[0] == "file" else entry
            for rel, entry in snapshot(r, digest=True, mtimes=True).items()
        }
        for r in roots
    }


def _fix(ckpt: Path, *extra: str) -> dict[str, Any]:
    res = kvprep("fix", str(ckpt), "--json", *extra, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return document(res)


def _ids(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in doc["findings"]}


@pytest.mark.slow
def test_second_fix_writes_nothing_and_loads_nothing(
    isolated_hf: Path, tmp_path: Path, shared_build_cache: Path
) -> None:
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "tiny")
    first = _fix(ckpt)
    assert first["smoke"]["ok"] is True and first["smoke_from_state"] is False
    assert first["verdict"] == "ready" and "smoke.load" in _ids(first)
    assert first["next"] == f"qwen-kvprep prestart {ckpt} -- <your server command>"

    before = _trees(ckpt, isolated_hf, shared_build_cache)
    second = _fix(ckpt)
    assert _trees(ckpt, isolated_hf, shared_build_cache) == before  # no byte, no mtime
    ids = _ids(second)
    assert "smoke.load" not in ids  # no child loaded the model
    assert ids["smoke.recorded"]["severity"] == "ok"
    assert second["smoke_from_state"] is True and second["smoke"]["ok"] is True
    assert second["verdict"] == "ready"

    # text output: the verdict and the next command
    res = kvprep("fix", str(ckpt), timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Result: ready: nothing changed since the smoke passed" in res.stdout
    assert f"Next: qwen-kvprep prestart {ckpt} -- <your server command>" in res.stdout
    assert _log_lines(res.stderr)[-1].startswith("smoke test: passed before")
    assert _trees(ckpt, isolated_hf, shared_build_cache) == before

    # --smoke runs it anyway, and records the new verdict
    state = ckpt / ".qwen-kvprep" / "state.json"
    forced = _fix(ckpt, "--smoke")
    assert "smoke.load" in _ids(forced) and forced["smoke_from_state"] is False
    assert state.stat().st_mtime_ns != before[str(ckpt)][".qwen-kvprep/state.json"][-1]

    # a weight file rewritten (a new revision with the same config) is proved again
    weights = next(p for p in ckpt.iterdir() if p.suffix == ".safetensors")
    stamp = weights.stat().st_mtime_ns + 10**9
    os.utime(weights, ns=(stamp, stamp))
    again = _fix(ckpt)
    assert "smoke.load" in _ids(again) and again["smoke_from_state"] is False


# `fix` with the model load made slow and the heartbeat short, in a process of its own
# (transformers keeps the modules-cache root it found at its first import, so an
# in-process fix could plant where an earlier test's HF_MODULES_CACHE was)
_SLOW_LOAD = """
import sys, time
import qwen_kvprep.smoke as smoke
from qwen_kvprep.smoke import progress
from qwen_kvprep.smoke.protocol import PHASE_LOAD

progress.HEARTBEAT_S = 0.5
real = smoke.run_smoke

def slow_load(directory, options, on_phase=None):
    def phase(name):
        on_phase(name)
        if name == PHASE_LOAD:
            time.sleep(1.6)  # the parent hears nothing while a big model loads
    return real(directory, options, on_phase=phase)

smoke.run_smoke = slow_load
from qwen_kvprep.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_piped_fix_beats_while_the_smoke_loads(isolated_hf: Path, tmp_path: Path) -> None:
    """The model load of a real 7B takes minutes: the log says it is still loading."""
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "tiny")
    res = kvprep("fix", str(ckpt), entry=(sys.executable, "-c", _SLOW_LOAD), timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    said = _log_lines(res.stderr)
    assert "smoke: loading the model ..." in said, said
    assert [s for s in said if s.startswith("still smoke: loading the model (")], said
    assert "Result: ready: the Int8 KV cache works" in res.stdout


def test_a_dry_run_names_the_command_that_applies_it(
    isolated_hf: Path, tmp_path: Path, shared_build_cache: Path
) -> None:
    """The same choices, less --dry-run: a view's OUT is not a checkpoint to fix, and
    `fix DIR` alone would install the fast path the preview left out."""
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "tiny")
    out = tmp_path / "the view"
    res = invoke("fix", str(ckpt), "--dry-run", "--no-fast-path", "-o", str(out), "--json",
                 "--cache-dir", str(shared_build_cache))
    assert res.returncode == 0, res.stdout + res.stderr
    doc = document(res)
    assert doc["verdict"] == "dry_run"
    assert doc["next"] == (f"qwen-kvprep fix {ckpt} --no-fast-path --output '{out}' "
                           f"--cache-dir {shared_build_cache}")
    res = invoke("fix", str(ckpt), "--dry-run", "--cache-dir", str(shared_build_cache))
    assert f"Next: qwen-kvprep fix {ckpt} --cache-dir {shared_build_cache}" in res.stdout


def test_a_dry_run_previews_the_loader_a_new_build_gets(
    isolated_hf: Path, tmp_path: Path, slow_fake_worker: dict[str, Any]
) -> None:
    """With nothing built yet, the preview's loader names the key the build will have, so
    the dry run lists the bytes the fix then writes."""
    from qwen_kvprep.tiny import generate_checkpoint

    slow_fake_worker["seconds"] = 0.0
    ckpt = generate_checkpoint(tmp_path / "tiny")
    cache = tmp_path / "cache"  # empty, and never the shared one: this build is a fake
    res = invoke("fix", str(ckpt), "--dry-run", "--json", "--cache-dir", str(cache))
    assert res.returncode == 0, res.stdout + res.stderr
    previewed = {w["path"]: w["bytes"] for w in document(res)["would_write"]}
    res = invoke("fix", str(ckpt), "--no-smoke", "--json", "--cache-dir", str(cache))
    assert res.returncode == 0, res.stdout + res.stderr
    loader = ckpt / "cpp_kernels.py"
    assert previewed[str(loader)] == loader.stat().st_size
