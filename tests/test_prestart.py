"""`prestart`: the fast path (no torch/transformers/huggingface_hub, exec CMD), its
comparison with the recorded state, and the slow path through fix on real tiny
checkpoints (fresh modules cache, re-patched config, read-only --output, 8 replicas)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from qwen_kvprep import __version__, common, quickstart
from qwen_kvprep.quickstart import Request, parse_fast, state_mismatch
from tests.cli import ENTRY, kvprep
from tests.remote_code import code_folder, hashed_folders
from tests.toolkit import NO_TOOLKIT
from tests.treesnap import snapshot

HEAVY = ("torch", "transformers", "huggingface_hub")
# The fast path also avoids these: each would add milliseconds to every container start.
AVOIDED = (*HEAVY, "click", "importlib.metadata", "qwen_kvprep.cli", "qwen_kvprep.journal.writer",
           "_hashlib", "pathlib", "typing")
CONSOLE_SCRIPT = Path(sys.executable).with_name("qwen-kvprep")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_prestart(
    *args: str, env: Optional[dict[str, str]] = None, timeout: float = 900, script: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run prestart as a container would: in a process of its own, started afresh (what
    prestart imports is part of what these tests check), through the real entry."""
    entry = (str(CONSOLE_SCRIPT),) if script else ENTRY
    return kvprep("prestart", *args, env=env, timeout=timeout, entry=entry, fork=False)


# ------------------------------------------------------------------ argument parsing


def test_parse_fast_reads_options_env_and_command(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DIR", "OUTPUT", "SMOKE", "ALLOW_FALLBACK", "CACHE", "ARCH", "QUIET"):
        monkeypatch.delenv(f"QWEN_KVPREP_{name}", raising=False)
    req = parse_fast(["/m", "--smoke", "--output=/o", "--", "python", "--smoke", "x"])
    assert req is not None
    assert (req.directory, req.output, req.smoke, req.allow_fallback) == ("/m", "/o", True, False)
    assert req.command == ["python", "--smoke", "x"]  # CMD's own options stay CMD's

    monkeypatch.setenv("QWEN_KVPREP_DIR", "/env-model")
    monkeypatch.setenv("QWEN_KVPREP_ALLOW_FALLBACK", "yes")
    monkeypatch.setenv("QWEN_KVPREP_ARCH", "8.0;9.0")
    req = parse_fast(["--", "serve"])
    assert req is not None
    assert (req.directory, req.allow_fallback, req.arch, req.command) == (
        "/env-model", True, "8.0;9.0", ["serve"]
    )
    req = parse_fast(["/m", "-o", "/o2", "--cache-dir", "/c", "-q", "--source", "vendored"])
    assert req is not None
    assert (req.output, req.cache_dir, req.quiet, req.command, req.source) == (
        "/o2", "/c", True, [], "vendored"
    )


@pytest.mark.parametrize(
    "args",
    [["--help"], ["/m", "--no-such"], ["/a", "/b"], ["/m", "--output"], ["-h", "--", "x"],
     ["/m", "--source", "elsewhere"]],
)
def test_parse_fast_leaves_anything_unusual_to_click(args: list[str]) -> None:
    assert parse_fast(args) is None


def test_parse_fast_leaves_bad_env_values_to_click(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWEN_KVPREP_SMOKE", "perhaps")
    assert parse_fast(["/m"]) is None


def test_parse_fast_leaves_an_unreadable_arch_to_click(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even where the recorded build is CPU-only and never compares it: click says what is
    wrong with it (exit 2) on every start, not first on a GPU machine."""
    monkeypatch.delenv("QWEN_KVPREP_ARCH", raising=False)
    assert parse_fast(["/m", "--arch", "abc", "--", "x"]) is None
    assert parse_fast(["/m", "--arch", "Ampere;sm_90", "--", "x"]) is not None
    monkeypatch.setenv("QWEN_KVPREP_ARCH", "8.0;amperes")
    assert parse_fast(["/m", "--", "x"]) is None
    monkeypatch.setenv("QWEN_KVPREP_ARCH", "")  # unset, as click reads it too
    assert parse_fast(["/m", "--", "x"]) is not None


# ------------------------------------------------------------------ helpers equal their originals


def test_dist_version_agrees_with_importlib_metadata() -> None:
    names = {d.metadata["Name"] for d in importlib.metadata.distributions()}
    assert {"torch", "transformers", "click"} <= names
    for name in sorted(names):
        assert quickstart.dist_version(name) == importlib.metadata.version(name), name
    assert quickstart.dist_version("no-such-distribution-qwen-kvprep") is None


def test_python_tag_agrees_with_the_build_cache() -> None:
    from qwen_kvprep.buildcache.builder import python_tag

    assert quickstart.python_tag() == python_tag()


# ------------------------------------------------------------------ a recorded state, made by hand


def fake_prepared(root: Path) -> Path:
    """A directory with the state fix records, built by hand (no build, no transformers):
    what the fast path compares is all there and consistent."""
    ckpt = root / "Fake-Chat"
    ckpt.mkdir(parents=True)
    for name, text in [("config.json", '{"use_cache_kernel": true}\n'),
                       ("cpp_kernels.py", "# qwen-kvprep loader\n"),
                       ("cache_autogptq_cuda_256.cpp", "// cpp\n"),
                       ("cache_autogptq_cuda_kernel_256.cu", "// cu\n"),
                       ("qwen_kvprep_kv.py", "# fast path\n"),
                       ("qwen_kvprep_compat.py", "# compatibility\n"),
                       ("modeling_qwen.py", "# model code\n"),
                       ("model.safetensors", "weights")]:
        (ckpt / name).write_text(text)
    build = root / "cache" / "builds" / "k1"
    build.mkdir(parents=True)
    (build / "cache_autogptq_cuda_256.so").write_bytes(b"\x7fELF")
    (build / "manifest.json").write_text(json.dumps(
        {"manifest_version": 1, "key": "k1", "inputs": {"python_tag": common.python_tag()},
         "so_sha256": sha(build / "cache_autogptq_cuda_256.so")}))
    modules_root = Path(os.environ["HF_MODULES_CACHE"])
    folder = modules_root / "transformers_modules" / "Fake-Chat"
    folder.mkdir(parents=True)
    planted = {}
    for name in common.MODULE_FILES:
        shutil.copy(ckpt / name, folder / name)
        planted[name] = sha(folder / name)
    state = {
        "state_version": 1,
        "tool_version": __version__,
        "checkpoint": str(ckpt),
        "files": {n: sha(ckpt / n) for n in common.TRACKED_FILES},
        "sources": {"origin": "vendored", "repo_id": None, "revision": None},
        "packages": {n: importlib.metadata.version(n) for n in ("torch", "transformers")},
        "build": {"key": "k1", "dir": str(build), "so": str(build / "cache_autogptq_cuda_256.so"),
                  "cuda": True, "arch_list": ["8.0", "9.0+PTX"],
                  "so_sha256": sha(build / "cache_autogptq_cuda_256.so"), "so_size": 4},
        "modules": {"root": str(modules_root), "folder": str(folder), "files": planted},
        "smoke": None,
        "updated": "2025-01-01T00:00:00+00:00",
    }
    (ckpt / ".qwen-kvprep").mkdir()
    (ckpt / ".qwen-kvprep" / "state.json").write_text(json.dumps(state, indent=2))
    return ckpt


@pytest.fixture()
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.delenv("QWEN_KVPREP_ARCH", raising=False)
    return fake_prepared(tmp_path)


def edit_state(ckpt: Path, **changes: Any) -> None:
    path = ckpt / ".qwen-kvprep" / "state.json"
    state = json.loads(path.read_text())
    state.update(changes)
    path.write_text(json.dumps(state))


def test_a_matching_state_is_recognised(fake: Path) -> None:
    assert state_mismatch(Request(str(fake))) is None


@pytest.mark.parametrize("change", ["planted", "modules-root"])
def test_modules_copies_are_planted_without_torch(
    fake: Path, change: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fresh container (empty or other modules cache) gets the copies from the checkpoint's
    verified files on the fast path, in the folder transformers will use."""
    state = json.loads((fake / ".qwen-kvprep" / "state.json").read_text())
    folder = Path(state["modules"]["folder"])
    if change == "planted":
        (folder / "cache_autogptq_cuda_256.cpp").unlink()
    else:
        folder = tmp_path / "fresh-modules" / "transformers_modules" / "Fake-Chat"
        monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "fresh-modules"))
    assert state_mismatch(Request(str(fake))) is None
    for name, digest in state["modules"]["files"].items():
        assert sha(folder / name) == digest
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("config", "config.json changed"),
        ("loader", "cpp_kernels.py changed"),
        ("source", "cache_autogptq_cuda_kernel_256.cu changed"),
        ("torch", "torch is"),
        ("transformers", "transformers is"),
        ("so", "build"),
        ("manifest", "manifest"),
        ("python", "this Python"),
        ("so-damaged", "changed size"),
        ("rebuilt", "not the one fix recorded"),
        ("planted-foreign", "modules cache"),
        ("modules-readonly", "cannot plant"),
        ("no-state", "no state"),
        ("tool", "recorded by qwen-kvprep"),
        ("moved", "recorded for"),
        ("arch", "--arch"),
        ("smoke", "smoke"),
        ("vendored", "--source vendored"),
        ("hub", "--source hub"),
    ],
)
def test_each_change_is_noticed(
    fake: Path, change: str, expected: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    state = json.loads((fake / ".qwen-kvprep" / "state.json").read_text())
    build = Path(state["build"]["dir"])
    request = Request(str(fake))
    if change == "config":
        (fake / "config.json").write_text('{"use_cache_kernel": false}\n')
    elif change == "loader":
        (fake / "cpp_kernels.py").write_text("# the official loader again\n")
    elif change == "source":
        (fake / "cache_autogptq_cuda_kernel_256.cu").unlink()
    elif change in ("torch", "transformers"):
        edit_state(fake, packages={**state["packages"], change: "0.0.1"})
    elif change == "so":
        (build / "cache_autogptq_cuda_256.so").unlink()
    elif change == "manifest":
        (build / "manifest.json").unlink()
    elif change == "so-damaged":  # truncated by a full disk, say: the loader would rebuild
        (build / "cache_autogptq_cuda_256.so").write_bytes(b"\x7f")
    elif change == "rebuilt":
        # pruned and compiled again by the loader: same size, another library
        (build / "cache_autogptq_cuda_256.so").write_bytes(b"\x7fELG")
        manifest = json.loads((build / "manifest.json").read_text())
        manifest["so_sha256"] = sha(build / "cache_autogptq_cuda_256.so")
        (build / "manifest.json").write_text(json.dumps(manifest))
    elif change == "python":
        manifest = json.loads((build / "manifest.json").read_text())
        manifest["inputs"] = {"python_tag": "cp27"}
        (build / "manifest.json").write_text(json.dumps(manifest))
    elif change == "planted-foreign":
        # a different copy in the modules cache, and the recorded one is not at hand in
        # the checkpoint either: nothing trustworthy to plant from
        (Path(state["modules"]["folder"]) / "cache_autogptq_cuda_256.cpp").write_text("x")
        edit_state(fake, modules={**state["modules"], "files": {
            **state["modules"]["files"], "cache_autogptq_cuda_256.cpp": "0" * 64}})
    elif change == "modules-readonly":
        blocker = tmp_path / "not-a-folder"
        blocker.write_text("a file where the modules cache should be")
        monkeypatch.setenv("HF_MODULES_CACHE", str(blocker))
    elif change == "no-state":
        (fake / ".qwen-kvprep" / "state.json").unlink()
    elif change == "tool":
        edit_state(fake, tool_version="0.0.0")
    elif change == "moved":
        moved = fake.with_name("Moved-Chat")
        fake.rename(moved)
        request = Request(str(moved))
    elif change == "arch":
        request = Request(str(fake), arch="8.6")
    elif change == "smoke":
        request = Request(str(fake), smoke=True)
    elif change in ("vendored", "hub"):
        request = Request(str(fake), source=change)
    reason = state_mismatch(request)
    assert reason is not None and expected in reason


def test_vendored_sources_satisfy_source_vendored(fake: Path) -> None:
    from qwen_kvprep.resources import KERNEL_FILES, kernels_dir

    files = json.loads((fake / ".qwen-kvprep" / "state.json").read_text())["files"]
    for name in KERNEL_FILES:
        shutil.copy(kernels_dir() / name, fake / name)
        files[name] = sha(fake / name)
    edit_state(fake, files=files)
    assert state_mismatch(Request(str(fake), source="vendored")) is None
    assert state_mismatch(Request(str(fake), source="auto")) is None


def test_a_prebuilt_variant_of_qwen_s_sources_satisfies_source_hub(
    fake: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fix --prebuilt --source hub records origin "prebuilt": prestart --source hub must
    judge the sources the variant was built from, or every start would run fix again."""
    from qwen_kvprep import catalogue
    from qwen_kvprep.resources import KERNEL_FILES

    state = json.loads((fake / ".qwen-kvprep" / "state.json").read_text())
    edit_state(fake, sources={**state["sources"], "origin": "prebuilt"})
    # the folder's sources as the official ones, as a variant built from Qwen's would be
    official = {
        name: catalogue.KnownFile(name, state["files"][name], 1) for name in KERNEL_FILES
    }
    monkeypatch.setattr(catalogue, "known_good", lambda: catalogue.KnownGood(official, ()))
    assert state_mismatch(Request(str(fake), source="hub")) is None
    other = dict(official, **{KERNEL_FILES[0]: catalogue.KnownFile(KERNEL_FILES[0], "0" * 64, 1)})
    monkeypatch.setattr(catalogue, "known_good", lambda: catalogue.KnownGood(other, ()))
    reason = state_mismatch(Request(str(fake), source="hub"))
    assert reason is not None and "not Qwen's official" in reason


def test_equivalent_arch_spellings_match(fake: Path) -> None:
    assert state_mismatch(Request(str(fake), arch="sm_80, 9.0+ptx")) is None


def test_a_passing_smoke_satisfies_smoke(fake: Path) -> None:
    edit_state(fake, smoke={"ok": True})
    assert state_mismatch(Request(str(fake), smoke=True)) is None
    edit_state(fake, smoke={"ok": False})
    assert state_mismatch(Request(str(fake), smoke=True)) is not None


# ------------------------------------------------------------------ the fast path, in a process


def imported_top_level(path: Path) -> set[str]:
    return {line.split(".")[0] for line in path.read_text().split()}


def loaded_at_start(tmp_path: Path, script: bool) -> set[str]:
    """The modules this interpreter has loaded when the first line of a program started as
    prestart is (a script, or `python -m`) runs: none of them is the fast path's doing.
    `python -m` on Python 3.9 loads typing itself (runpy -> importlib.util -> importlib.abc)."""
    probe = tmp_path / "kvprep_start_probe.py"
    probe.write_text("import sys\nprint('\\n'.join(sorted(sys.modules)))\n")
    head = [sys.executable, str(probe)] if script else [sys.executable, "-m", probe.stem]
    res = subprocess.run(head, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return set(res.stdout.split())


@pytest.mark.parametrize("script", [True, False], ids=["console-script", "python-m"])
def test_fast_path_execs_cmd_and_imports_nothing_heavy(
    fake: Path, tmp_path: Path, script: bool
) -> None:
    dump = tmp_path / "imports.txt"
    env = {**os.environ, "QWEN_KVPREP_DEBUG_IMPORTS": str(dump)}
    res = run_prestart(
        str(fake), "--", sys.executable, "-c", "print('hi'); raise SystemExit(7)",
        env=env, script=script,
    )
    assert res.returncode == 7, res.stderr
    assert res.stdout == "hi\n"  # prestart's own words go to stderr
    assert "is ready" in res.stderr
    modules = set(dump.read_text().split())
    assert "qwen_kvprep.quickstart" in modules
    interpreter = loaded_at_start(tmp_path, script)
    assert not [m for m in AVOIDED if m in modules and m not in interpreter]


def test_fast_path_imports_seen_by_importtime(fake: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "qwen_kvprep", "prestart", str(fake)],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    imported = {
        line.split("|")[-1].strip()
        for line in res.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "qwen_kvprep.quickstart" in imported
    assert not {m for m in imported if m.split(".")[0] in HEAVY or m == "click"}


def test_the_command_replaces_prestart(fake: Path) -> None:
    # exec, not a child: the pid CMD sees is the one prestart was started with
    proc = subprocess.Popen(
        [*ENTRY, "prestart", str(fake), "-q", "--",
         sys.executable, "-c", "import os; print(os.getpid())"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert int(out) == proc.pid
    assert err == ""  # -q


def test_no_command_exits_zero_and_a_missing_one_127(fake: Path) -> None:
    res = run_prestart(str(fake))
    assert res.returncode == 0 and res.stdout == ""
    res = run_prestart(str(fake), "--", "no-such-command-qwen-kvprep")
    assert res.returncode == 127
    assert "cannot run" in res.stderr and "Traceback" not in res.stderr


def test_directory_from_the_environment(fake: Path) -> None:
    env = {**os.environ, "QWEN_KVPREP_DIR": str(fake)}
    res = run_prestart("--", sys.executable, "-c", "print('env')", env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "env\n"


def test_a_cache_dir_naming_a_file_is_a_usage_error_on_the_fast_path(
    fake: Path, tmp_path: Path
) -> None:
    """The recorded state may match: a file as the build cache is still a mistake to say."""
    a_file = tmp_path / "hostname"
    a_file.write_text("x\n")
    for args, env in (
        (["--cache-dir", str(a_file)], None),
        ([], {**os.environ, "QWEN_KVPREP_CACHE": str(a_file)}),
    ):
        res = run_prestart(str(fake), *args, "--", "true", env=env)
        assert res.returncode == 2, res.stderr
        assert "is a file" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("where", ["missing-folder", "fifo"])
def test_an_unwritable_import_dump_does_not_stop_the_server(
    fake: Path, tmp_path: Path, where: str
) -> None:
    dump = "/nonexistent-qwen-kvprep/x.txt"
    if where == "fifo":  # nobody reads it: opening it for writing used to wait forever
        dump = str(tmp_path / "imports.fifo")
        os.mkfifo(dump)
    env = {**os.environ, "QWEN_KVPREP_DEBUG_IMPORTS": dump}
    res = run_prestart(str(fake), "--", sys.executable, "-c", "print('served')", env=env,
                       timeout=60)
    assert res.returncode == 0 and res.stdout == "served\n", res.stderr
    assert "warning: cannot write QWEN_KVPREP_DEBUG_IMPORTS" in res.stderr
    assert "Traceback" not in res.stderr


def test_dashes_without_a_command_are_a_usage_error(fake: Path) -> None:
    """An image whose CMD is empty must not look like a server that stopped cleanly."""
    assert parse_fast([str(fake), "--"]) is None  # left to click, which says what to pass
    for args, env in (([str(fake), "--"], None),
                      (["--"], {**os.environ, "QWEN_KVPREP_DIR": str(fake)})):
        res = run_prestart(*args, env=env)
        assert res.returncode == 2, res.stderr
        assert "nothing after `--`" in res.stderr and "prestart DIR -- " in res.stderr
        assert res.stdout == "" and "is ready" not in res.stderr
    assert run_prestart(str(fake)).returncode == 0  # without `--`: only prepare


def test_json_is_one_line_before_the_command(fake: Path, tmp_path: Path) -> None:
    dump = tmp_path / "imports.txt"
    env = {**os.environ, "QWEN_KVPREP_DEBUG_IMPORTS": str(dump)}
    res = run_prestart(str(fake), "--json", "--", sys.executable, "-c", "print('served')",
                       env=env)
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.splitlines()
    doc = json.loads(first)
    assert doc["ok"] is True and doc["schema_version"] == 1
    assert doc["prestart"]["ready"] is True and doc["prestart"]["prepared"] is None
    assert doc["prestart"]["command"][-1] == "print('served')"
    assert second == "served"
    assert "is ready" not in res.stderr  # the document says it
    assert "click" not in dump.read_text().split()  # still the fast path
    req = parse_fast([str(fake), "--debug", "--json", "--", "x"])
    assert req is not None and req.as_json
    # the global option before the command: the same line, still the fast path
    dump.unlink()
    res = kvprep("--json", "prestart", str(fake), "--", sys.executable, "-c", "print(1)",
                 env=env)
    assert res.returncode == 0 and json.loads(res.stdout.splitlines()[0])["ok"] is True
    assert "click" not in dump.read_text().split()


def test_json_of_a_fallback_carries_the_error(tmp_path: Path) -> None:
    bad = tmp_path / "Not-A-Model"
    bad.mkdir()
    res = run_prestart(str(bad), "--allow-fallback", "--json", "--", sys.executable, "-c",
                       "print('started')")
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.splitlines()
    doc = json.loads(first)
    assert doc["ok"] is False and doc["prestart"]["fallback"] is True
    assert doc["error"]["message"] and second == "started"
    assert "--allow-fallback" in res.stderr  # the warning stays on stderr


# ------------------------------------------------------------------ failures before CMD


def test_a_failure_stops_before_cmd_unless_fallback_is_allowed(tmp_path: Path) -> None:
    bad = tmp_path / "Not-A-Model"
    bad.mkdir()
    (bad / "README.md").write_text("nothing here")
    cmd = ["--", sys.executable, "-c", "print('started'); raise SystemExit(5)"]
    res = run_prestart(str(bad), *cmd)
    assert res.returncode == 1
    assert "started" not in res.stdout
    assert "error:" in res.stderr and "Traceback" not in res.stderr

    res = run_prestart(str(bad), "--allow-fallback", *cmd)
    assert res.returncode == 5 and res.stdout == "started\n"
    assert "--allow-fallback" in res.stderr

    env = {**os.environ, "QWEN_KVPREP_ALLOW_FALLBACK": "1", "QWEN_KVPREP_DIR": str(bad),
           "QWEN_KVPREP_QUIET": "1"}
    res = run_prestart(*cmd, env=env)
    assert res.returncode == 5, res.stderr
    assert "--allow-fallback" in res.stderr  # --quiet never hides that the kernel is off


def test_usage_errors_are_not_papered_over(tmp_path: Path) -> None:
    res = run_prestart(str(tmp_path / "missing"), "--allow-fallback", "--", "true")
    assert res.returncode == 2
    assert "no such directory" in res.stderr
    res = run_prestart("--", "true", env={k: v for k, v in os.environ.items()
                                          if k != "QWEN_KVPREP_DIR"})
    assert res.returncode == 2 and "QWEN_KVPREP_DIR" in res.stderr
    res = run_prestart(str(tmp_path), "python", "serve.py")  # CMD without --
    assert res.returncode == 2 and "after `--`" in res.stderr


# ------------------------------------------------------------------ real checkpoints, real fix

LOAD_AND_CHECK = """
import sys, warnings
# the silent fallbacks only warn ("... KV cache kernel(s) ..."): make them fail
warnings.filterwarnings("error", message=".*KV cache kernel")
import torch
from transformers import AutoModelForCausalLM
path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
layers = [m for m in model.modules() if hasattr(m, "kernel_calls")]
ids = torch.tensor([[1, 2, 3, 4]])
model.generate(ids, max_new_tokens=3, do_sample=False, min_new_tokens=3)
assert layers and all(l.cache_kernels is not None for l in layers), "kernel not loaded"
assert all(l.kernel_calls > 0 for l in layers), "kernel not called"
print("KERNEL-OK", type(layers[0].cache_kernels).__name__, sum(l.kernel_calls for l in layers))
"""


@pytest.fixture(scope="module")
def tiny_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qwen_kvprep.tiny import generate_checkpoint

    return generate_checkpoint(tmp_path_factory.mktemp("tiny") / "Tiny-Chat")


@pytest.fixture()
def model_env(tmp_path: Path, shared_build_cache: Path) -> Iterator[dict[str, str]]:
    """A container's view of the world: a fresh HF home and modules cache, the shared
    build cache (compiled once per session), one compile job (2 shared cores), no CUDA
    toolkit (the CPU-only build, whatever nvcc the machine has)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_KVPREP_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "hf" / "modules"),
               QWEN_KVPREP_CACHE=str(shared_build_cache), MAX_JOBS="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **NO_TOOLKIT)
    yield env


def copy_of(template: Path, where: Path, name: Optional[str] = None) -> Path:
    dest = where / (name or template.name)
    shutil.copytree(template, dest, symlinks=True)
    return dest


@pytest.mark.slow
def test_fresh_modules_cache_is_planted_and_the_kernel_runs(
    tiny_template: Path, tmp_path: Path, model_env: dict[str, str]
) -> None:
    ckpt = copy_of(tiny_template, tmp_path)
    check = ["--", sys.executable, "-c", LOAD_AND_CHECK, str(ckpt)]
    res = run_prestart(str(ckpt), *check, env=model_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "KERNEL-OK" in res.stdout
    assert "preparing" in res.stderr

    # the next start: nothing to do, nothing heavy imported
    dump = tmp_path / "imports.txt"
    res = run_prestart(str(ckpt), "--", "true", env={**model_env,
                                                    "QWEN_KVPREP_DEBUG_IMPORTS": str(dump)})
    assert res.returncode == 0 and "is ready" in res.stderr, res.stderr
    assert not imported_top_level(dump) & set(HEAVY)

    # a new container: empty modules cache -> the sources are planted there on the fast
    # path (no torch), and a load from that cache runs the kernel
    dump.unlink()
    fresh = {**model_env, "HF_MODULES_CACHE": str(tmp_path / "fresh-modules"),
             "QWEN_KVPREP_DEBUG_IMPORTS": str(dump)}
    res = run_prestart(str(ckpt), *check, env=fresh)
    assert res.returncode == 0, res.stderr[-3000:]
    planted_line = next(ln for ln in res.stderr.splitlines() if "planted " in ln)
    for name in ("cache_autogptq_cuda_256.cpp", "cache_autogptq_cuda_kernel_256.cu",
                 "cpp_kernels.py", "qwen_kvprep_kv.py"):  # the fast path's module too
        assert name in planted_line, planted_line
    assert "is ready" in res.stderr
    assert not imported_top_level(dump) & set(HEAVY)
    assert "KERNEL-OK" in res.stdout
    planted = list((tmp_path / "fresh-modules").rglob("cache_autogptq_cuda_kernel_256.cu"))
    # the folder of the checkpoint's name, and transformers_modules/ itself (a load by
    # the path with a trailing slash runs from there; not on transformers 5, where DIR/
    # runs from DIR's own folder)
    fresh_modules = tmp_path / "fresh-modules"
    slash = [] if hashed_folders() else [code_folder(fresh_modules, ckpt, "")]
    assert sorted(p.parent for p in planted) == sorted([*slash, code_folder(fresh_modules, ckpt)])
    for copy in planted:
        assert copy.read_bytes() == (ckpt / "cache_autogptq_cuda_kernel_256.cu").read_bytes()


@pytest.mark.slow
def test_a_config_switched_back_is_patched_again(
    tiny_template: Path, tmp_path: Path, model_env: dict[str, str]
) -> None:
    ckpt = copy_of(tiny_template, tmp_path)
    assert run_prestart(str(ckpt), env=model_env).returncode == 0
    config = json.loads((ckpt / "config.json").read_text())
    config["use_cache_kernel"] = False  # someone turned it off (or re-downloaded config.json)
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    res = run_prestart(str(ckpt), "--", sys.executable, "-c", "print('served')", env=model_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "config.json changed" in res.stderr
    assert res.stdout == "served\n"
    assert json.loads((ckpt / "config.json").read_text())["use_cache_kernel"] is True
    assert "is ready" in run_prestart(str(ckpt), env=model_env).stderr


@pytest.mark.slow
def test_output_view_of_a_read_only_checkpoint(
    tiny_template: Path, tmp_path: Path, model_env: dict[str, str]
) -> None:
    ckpt = copy_of(tiny_template, tmp_path / "ro")
    # root ignores modes, so read-only is proven by comparing, not by EACCES
    subprocess.run(["chmod", "-R", "a-w", str(ckpt)], check=True)
    before = snapshot(ckpt, mtimes=True)
    try:
        out = tmp_path / "prepared" / "Tiny-Chat"
        env = {**model_env, "QWEN_KVPREP_OUTPUT": str(out)}  # the env form of --output
        res = run_prestart(str(ckpt), "--", sys.executable, "-c", LOAD_AND_CHECK, str(out),
                           env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "KERNEL-OK" in res.stdout
        res = run_prestart(str(ckpt), "--output", str(out), env=model_env)
        assert res.returncode == 0 and "is ready" in res.stderr, res.stderr
        after = snapshot(ckpt, mtimes=True)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(ckpt)], check=True)
    assert after == before
    assert (out / "model.safetensors.index.json").is_symlink()
    assert not (out / "config.json").is_symlink()
    assert json.loads((out / "config.json").read_text())["use_cache_kernel"] is True


@pytest.mark.slow
def test_eight_replicas_start_together_on_one_shared_cache(
    tiny_template: Path, tmp_path: Path, model_env: dict[str, str]
) -> None:
    # Two model directories, four replicas on each, one modules cache and one build cache
    # for all: the per-directory lock and the build lock must let every one succeed.
    # (Different names: transformers gives same-named directories one modules folder.)
    dirs = [copy_of(tiny_template, tmp_path, f"Tiny-Chat-{i}") for i in range(2)]
    procs = []
    for i in range(8):
        ckpt = dirs[i % 2]
        procs.append(subprocess.Popen(
            [*ENTRY, "prestart", str(ckpt), "--",
             sys.executable, "-c", f"print('replica {i}')"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=model_env,
        ))
    results = [(p, *p.communicate(timeout=1200)) for p in procs]
    for i, (proc, out, err) in enumerate(results):
        assert proc.returncode == 0, err[-3000:]
        assert out == f"replica {i}\n"
    for ckpt in dirs:
        state = json.loads((ckpt / ".qwen-kvprep" / "state.json").read_text())
        assert state["files"]["config.json"] == sha(ckpt / "config.json")
        journal = json.loads((ckpt / ".qwen-kvprep" / "journal.json").read_text())
        assert "config.json" in journal["files"]  # the original kept once, for revert
        assert "is ready" in run_prestart(str(ckpt), env=model_env).stderr


def test_the_fast_sha256_is_sha256(tmp_path: Path) -> None:
    data = os.urandom(100_000)
    (tmp_path / "f").write_bytes(data)
    assert common.sha256_small(str(tmp_path / "f")) == hashlib.sha256(data).hexdigest()
    assert common.sha256_small(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("name", ["QWEN_KVPREP_SMOKE", "QWEN_KVPREP_QUIET",
                                  "QWEN_KVPREP_ALLOW_FALLBACK"])
def test_a_flag_variable_that_is_not_a_boolean_is_refused_by_its_name(
    fake: Path, name: str
) -> None:
    done = kvprep("prestart", str(fake), "--", "true", env={**os.environ, name: "maybe"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{name}='maybe' is not true or false" in done.stderr
    done = kvprep("prestart", str(fake), "--", "true", env={**os.environ, name: "0"})
    assert done.returncode == 0, done.stdout + done.stderr
