"""Reliability of fix and the build cache under the conditions of a real deployment:
replicas starting together, a builder killed half-way, a read-only cache, and revert.

These compile the CPU extension in private caches (the point is what happens while a
build runs), so they are slow; each test compiles at most once.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from qwen_kvprep.resources import KERNEL_FILES
from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.cli import ENTRY, kvprep
from tests.remote_code import code_folder
from tests.toolkit import NO_TOOLKIT
from tests.treesnap import snapshot

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def _env(tmp: Path, cache: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HOME=str(tmp / "hf-home"),
        HF_MODULES_CACHE=str(tmp / "hf-home" / "modules"),
        QWEN_KVPREP_CACHE=str(cache),
        MAX_JOBS=os.environ.get("MAX_JOBS", "2"),
        **NO_TOOLKIT,  # the CPU-only build, whatever nvcc the machine has
    )
    env.update(extra)
    return env


def _start(args: list[str], env: dict[str, str], cwd: Path, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*ENTRY, *args],
        env=env,
        cwd=str(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return kvprep(*args, env=env, cwd=cwd, timeout=1800)


def _build_finding(stdout: str) -> dict[str, Any]:
    doc = json.loads(stdout)
    return next(f for f in doc["findings"] if f["id"] == "build.build")


def test_eight_fixes_at_once_all_succeed_and_one_compiles(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "tiny")
    original = snapshot(ckpt)
    env = _env(tmp_path, tmp_path / "cache")
    fixes = [_start(["fix", str(ckpt), "--no-smoke", "--json"], env, tmp_path) for _ in range(8)]
    # two bare builders of the same key race the fixes for the build lock itself
    builds = [_start(["build", "--json"], env, tmp_path) for _ in range(2)]
    results = [(p, *p.communicate(timeout=1800)) for p in fixes + builds]
    for proc, _out, err in results:
        assert proc.returncode == 0, err[-3000:]
    # (one key unless kernels/ was edited while the test ran)
    keys = {_build_finding(out)["details"]["key"] for _, out, _ in results}
    assert len(keys) == 1, keys
    compiled = [_build_finding(out)["details"]["compiled"] for _, out, _ in results]
    assert compiled.count(True) == 1, compiled
    stderr = "\n".join(err for _, _, err in results)
    # someone waited on the builder and said whom for
    assert "waiting for build lock held by pid " in stderr, stderr[-3000:]
    builds_dir = tmp_path / "cache" / "builds"
    assert [p.name for p in builds_dir.iterdir()] == list(keys)
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []
    # the fixes took turns: the journal kept the true originals, so revert is exact
    done = _run(["revert", str(ckpt)], env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert snapshot(ckpt) == original


def _worker_pids(marker: str) -> list[int]:
    """Processes whose command line mentions `marker` (the cache path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def _wait_for(predicate: Any, timeout: float) -> Optional[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    return None


def test_builder_killed_mid_compile_blocks_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = _env(tmp_path, cache, QWEN_KVPREP_LOCK_TIMEOUT="5")
    victim = _start(["build", "--json"], env, tmp_path)
    ninja = _wait_for(lambda: list((cache / "tmp").glob("*/build/build.ninja")), 300)
    assert ninja, "the build never started compiling"
    staging = ninja[0].parent.parent
    time.sleep(2)  # the compiler is running now
    assert _worker_pids(str(staging)), "no compile process seen"
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    # the orphaned worker and its compilers go down with their parent
    assert _wait_for(lambda: not _worker_pids(str(staging)), 30), _worker_pids(str(staging))
    assert not (cache / "builds").exists() or not any((cache / "builds").iterdir())

    ckpt = generate_checkpoint(tmp_path / "tiny")
    start = time.monotonic()
    done = _run(["fix", str(ckpt), "--no-smoke", "--json"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _build_finding(done.stdout)["details"]["compiled"] is True
    assert "waiting for build lock" not in done.stderr
    assert _build_finding(done.stdout)["details"]["waited_seconds"] == 0
    assert not staging.exists()  # the dead build's folder was collected
    assert list((cache / "tmp").iterdir()) == []
    assert time.monotonic() - start < 1500


def _drop_dac_override() -> None:
    """In the child, before exec: root without CAP_DAC_OVERRIDE obeys file modes."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop = 24
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _read_only_runner() -> Optional[Any]:
    if os.geteuid() != 0:
        return None
    return _drop_dac_override


@pytest.mark.parametrize("command", ["build", "fix"])
def test_read_only_cache_is_a_clear_error(tmp_path: Path, command: str) -> None:
    cache = tmp_path / "ro-cache"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        preexec = _read_only_runner()
        probe = subprocess.run(
            ["touch", str(cache / "probe")], preexec_fn=preexec, capture_output=True
        )
        if probe.returncode == 0:
            needs.skip("non-root", "cannot make a folder read-only for this user here")
        ckpt = generate_checkpoint(tmp_path / "tiny")
        args = ["build"] if command == "build" else ["fix", str(ckpt), "--no-smoke"]
        done = kvprep(*args, env=_env(tmp_path, cache), cwd=tmp_path, timeout=600,
                      preexec_fn=preexec)
    finally:
        cache.chmod(0o755)
    assert done.returncode == 1, done.stdout + done.stderr
    err = done.stderr
    assert f"the build cache folder {cache} is not writable" in err, err
    assert "--cache-dir DIR" in err and "QWEN_KVPREP_CACHE=DIR" in err
    assert "Traceback" not in err
    if command == "fix":
        # the model must fall back, not JIT-build and crash, after a failed fix
        assert (ckpt / "cpp_kernels.py").read_text().startswith("# qwen-kvprep loader")


def test_cache_path_naming_a_file_is_refused_before_the_first_write(
    tmp_path: Path, shared_build_cache: Path
) -> None:
    ckpt = generate_checkpoint(tmp_path / "tiny")
    before = snapshot(ckpt)
    not_a_folder = tmp_path / "hostname"
    not_a_folder.write_text("a file\n")
    done = kvprep("fix", str(ckpt), "--no-smoke", env=_env(tmp_path, not_a_folder),
                  cwd=tmp_path, timeout=600)
    # $QWEN_KVPREP_CACHE naming a file: a usage error, as --cache-dir naming one is
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"the build cache {not_a_folder} is not a folder" in done.stderr
    assert "Traceback" not in done.stderr
    assert snapshot(ckpt) == before  # nothing written: not even the config or the loader


def test_a_failed_build_keeps_a_loader_that_works(tmp_path: Path, shared_build_cache: Path) -> None:
    """The next fix cannot use its build cache: the loader of the fix that worked, which
    points at the build that works, stays; only the original cpp_kernels.py is replaced."""
    ckpt = generate_checkpoint(tmp_path / "tiny")
    done = _run(["fix", str(ckpt), "--no-smoke"], _env(tmp_path, shared_build_cache), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    working = (ckpt / "cpp_kernels.py").read_bytes()
    unusable = tmp_path / "ro"
    unusable.mkdir()
    (unusable / "builds").write_text("in the way\n")  # the cache cannot hold builds
    done = _run(["fix", str(ckpt), "--no-smoke"], _env(tmp_path, unusable), tmp_path)
    assert done.returncode == 1, done.stderr
    assert f"{unusable / 'builds'} is a file, not a folder" in done.stderr
    assert (ckpt / "cpp_kernels.py").read_bytes() == working
    assert "installed the loader although the build failed" not in done.stdout


def test_revert_after_fix_is_byte_identical(tmp_path: Path, shared_build_cache: Path) -> None:
    """Including a config.json that is a symlink into a huggingface_hub-like blob store."""
    ckpt = generate_checkpoint(tmp_path / "tiny")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.move(str(ckpt / "config.json"), blobs / "abc123")
    (ckpt / "config.json").symlink_to(blobs / "abc123")
    (ckpt / "extra.txt").write_text("left alone\n")
    os.chmod(ckpt / "extra.txt", 0o600)
    before, blobs_before = snapshot(ckpt), snapshot(blobs)
    env = _env(tmp_path, shared_build_cache)

    done = _run(["fix", str(ckpt), "--no-smoke"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    modules = code_folder(Path(env["HF_MODULES_CACHE"]), ckpt)  # of the code fix left
    assert not (ckpt / "config.json").is_symlink()  # replaced, never written through
    assert snapshot(blobs) == blobs_before
    for name in (*KERNEL_FILES, "cpp_kernels.py"):
        assert (modules / name).is_file()

    done = _run(["revert", str(ckpt)], env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert snapshot(ckpt) == before
    assert snapshot(blobs) == blobs_before
    for name in KERNEL_FILES:  # planted by fix, absent before: gone again
        assert not (modules / name).exists()
    assert "build cache" in done.stdout  # says the shared build cache is kept


def test_a_folder_in_place_of_state_json_is_refused_before_the_first_write(
    tmp_path: Path, shared_build_cache: Path
) -> None:
    ckpt = generate_checkpoint(tmp_path / "tiny")
    env = _env(tmp_path, shared_build_cache)
    assert _run(["fix", str(ckpt), "--no-smoke"], env, tmp_path).returncode == 0
    state = ckpt / ".qwen-kvprep" / "state.json"
    state.unlink()
    state.mkdir()
    (ckpt / "config.json").write_text((ckpt / "config.json").read_text().replace(
        '"use_cache_kernel": true', '"use_cache_kernel": false'))
    config = (ckpt / "config.json").read_bytes()
    done = _run(["fix", str(ckpt), "--no-smoke"], env, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{state} is a folder" in done.stderr and "rm -r" in done.stderr
    assert "Traceback" not in done.stderr and ".tmp" not in done.stderr
    assert (ckpt / "config.json").read_bytes() == config  # refused before writing it
