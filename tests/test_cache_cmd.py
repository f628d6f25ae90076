"""`qwen-kvprep cache list` and `cache prune`, over hand-made build folders and prepared
folders (nothing is compiled)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from qwen_kvprep.buildcache.inventory import prune, register_user, take_inventory
from qwen_kvprep.buildcache.marker import claim
from qwen_kvprep.buildcache.paths import CacheLayout
from tests.cli import invoke

INPUTS = {
    "sources": {}, "flags": {}, "torch": "2.10.0+cu130", "torch_cuda": "13.0",
    "cxx11_abi": True, "python_tag": "cp311", "machine": "x86_64", "arch_list": ["9.0"],
    "nvcc": "13.0", "tool_version": "0.1.0",
}


def publish(layout: CacheLayout, key: str, origin: Optional[str] = "compiled",
            **extra: Any) -> Path:
    folder = layout.build_dir(key)
    folder.mkdir(parents=True)
    so = folder / "cache_autogptq_cuda_256.so"
    so.write_bytes(b"\x7fELF fake " + key.encode())
    manifest: dict[str, Any] = {
        "manifest_version": 1, "key": key, "inputs": INPUTS, "cuda": True, "so": so.name,
        "so_sha256": hashlib.sha256(so.read_bytes()).hexdigest(),
        "created": "2026-01-02T03:04:05Z", **extra,
    }
    if origin is not None:
        manifest["origin"] = origin
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def prepared(tmp_path: Path, name: str, layout: CacheLayout, key: str) -> str:
    """A folder whose state.json says it uses build `key`, registered as its user."""
    folder = tmp_path / name
    (folder / ".qwen-kvprep").mkdir(parents=True)
    build = layout.build_dir(key)
    state = {
        "state_version": 1, "tool_version": "0.1.0", "checkpoint": str(folder), "files": {},
        "packages": {}, "build": {"key": key, "dir": str(build),
                                  "so": str(build / "cache_autogptq_cuda_256.so")},
    }
    (folder / ".qwen-kvprep" / "state.json").write_text(json.dumps(state))
    register_user(layout, key, str(folder))
    return str(folder)


def run(*args: str) -> Any:
    """The command in this process: its exit code, and stdout then stderr as `output`."""
    done = invoke(*args)
    return SimpleNamespace(exit_code=done.returncode, output=done.stdout + done.stderr)


@pytest.fixture()
def layout(tmp_path: Path) -> CacheLayout:
    cache = CacheLayout(tmp_path / "cache")
    claim(cache.root)  # as qwen-kvprep makes one: marked
    return cache


def test_list_shows_builds_their_origin_and_verified_users(
    tmp_path: Path, layout: CacheLayout
) -> None:
    publish(layout, "a" * 64)
    publish(layout, "b" * 64, origin="prebuilt", source="org/kernels")
    publish(layout, "c" * 64, origin=None)
    user = prepared(tmp_path, "model", layout, "a" * 64)
    # a record of a folder prepared with another build does not count
    other = prepared(tmp_path, "moved", layout, "b" * 64)
    register_user(layout, "c" * 64, other)
    result = run("cache", "list", "--cache-dir", str(layout.root))
    assert result.exit_code == 0, result.output
    assert "aaaaaaaaaaaa  compiled  torch 2.10.0+cu130, CUDA 13.0, cp311" in result.output
    assert "prebuilt org/kernels" in result.output
    assert "cccccccccccc  old" in result.output
    assert f"used by {user}" in result.output
    assert result.output.count(f"used by {other}") == 1  # b's, not c's
    assert "3 builds" in result.output


def test_list_json_shape(tmp_path: Path, layout: CacheLayout) -> None:
    publish(layout, "a" * 64)
    user = prepared(tmp_path, "model", layout, "a" * 64)
    (layout.logs).mkdir()
    (layout.logs / "x-1.log").write_text("failed")
    result = run("cache", "list", "--cache-dir", str(layout.root), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)["cache"]
    assert doc["root"] == str(layout.root) and doc["exists"] is True
    (build,) = doc["builds"]
    assert build["key"] == "a" * 64 and build["origin"] == "compiled"
    assert build["users"] == [user] and build["locked"] is False
    assert build["torch"] == "2.10.0+cu130" and build["python_tag"] == "cp311"
    assert isinstance(build["last_chosen"], str) and build["size"] > 0
    assert [x["kind"] for x in doc["leftovers"]] == ["log"]
    assert doc["total_size"] == build["size"] + 6


def test_prune_keeps_used_builds_and_removes_unused_and_old_ones(
    tmp_path: Path, layout: CacheLayout
) -> None:
    used = publish(layout, "a" * 64)
    unused = publish(layout, "b" * 64)
    old = publish(layout, "c" * 64, origin=None)
    prepared(tmp_path, "model", layout, "a" * 64)
    gone = prepared(tmp_path, "deleted", layout, "b" * 64)
    (Path(gone) / ".qwen-kvprep" / "state.json").unlink()  # reverted: a stale record
    result = run("cache", "prune", "--cache-dir", str(layout.root), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)["prune"]
    assert used.is_dir() and not unused.exists() and not old.exists()
    assert {r["path"] for r in doc["removed"]} == {str(unused), str(old)}
    assert doc["kept"][0]["key"] == "a" * 64 and doc["dry_run"] is False
    assert doc["freed"] > 0
    assert not layout.users_dir("b" * 64).exists()
    assert sorted(os.listdir(layout.tmp)) == []  # the pruned builds passed through tmp/


def test_dry_run_changes_nothing(layout: CacheLayout) -> None:
    publish(layout, "b" * 64)
    layout.logs.mkdir()
    log = layout.logs / "b-1.log"
    log.write_text("old failure")
    os.utime(log, (time.time() - 30 * 86400,) * 2)
    before = sorted(str(p) for p in layout.root.rglob("*"))
    result = run("cache", "prune", "--dry-run", "--cache-dir", str(layout.root))
    assert result.exit_code == 0, result.output
    assert "would remove build" in result.output and "would remove log" in result.output
    assert "would free" in result.output
    assert sorted(str(p) for p in layout.root.rglob("*")) == before


def test_a_held_build_lock_protects_a_build(layout: CacheLayout) -> None:
    folder = publish(layout, "b" * 64)
    layout.locks.mkdir(parents=True)
    # held by another process: flock locks of one process do not exclude each other here
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import filelock, sys; l = filelock.FileLock(sys.argv[1]); l.acquire(); "
         "print('held', flush=True); sys.stdin.read()", str(layout.lock_path("b" * 64))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        result = prune(layout)
        assert folder.is_dir()
        assert result.kept == [("b" * 64, "its build lock is held (being built or installed)")]
    finally:
        holder.communicate("")
    prune(layout)
    assert not folder.exists()


def test_prune_leaves_tmp_of_a_running_build_and_removes_leftovers(layout: CacheLayout) -> None:
    layout.tmp.mkdir(parents=True)
    left = layout.tmp / "k1.123.abc"
    left.mkdir()
    (left / "x.o").write_bytes(b"x")
    fresh = layout.tmp / "k2.456.def"
    fresh.mkdir()
    os.utime(left, (time.time() - 2 * 86400,) * 2)
    prune(layout)
    assert not left.exists() and fresh.exists()


def test_prune_never_follows_a_link(tmp_path: Path, layout: CacheLayout) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    publish(layout, "b" * 64)
    os.symlink(outside, layout.build_dir("b" * 64) / "link")
    layout.builds.joinpath("linked").symlink_to(outside)
    prune(layout)
    assert (outside / "keep").read_text() == "mine"
    assert not layout.build_dir("b" * 64).exists()
    assert take_inventory(layout).builds == []


def test_a_read_only_cache_is_a_clear_error(
    layout: CacheLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(layout, "b" * 64)
    real_mkdir = Path.mkdir

    def read_only(self: Path, *args: Any, **kwargs: Any) -> None:
        # root writes into a folder without write permission: refuse as a read-only mount
        if self.parent == layout.builds:
            raise PermissionError(13, "Permission denied", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    result = run("cache", "prune", "--cache-dir", str(layout.root))
    assert result.exit_code == 1
    assert "not writable" in result.output and "--cache-dir" in result.output
    assert "Traceback" not in result.output
    assert layout.build_dir("b" * 64).is_dir()


def test_fix_registers_the_folder_as_a_user_of_its_build(
    tmp_path: Path, layout: CacheLayout
) -> None:
    from qwen_kvprep.findings import ok
    from qwen_kvprep.steps.context import FixContext

    build = publish(layout, "a" * 64)
    folder = str(tmp_path / "model")
    manifest = json.loads((build / "manifest.json").read_text())
    result: Any = SimpleNamespace(key="a" * 64, dir=build, to_json=dict, manifest=manifest)
    for dry_run in (True, False):
        ctx = FixContext(
            Path(folder),
            options=SimpleNamespace(dry_run=dry_run),  # type: ignore[arg-type]
            journal=SimpleNamespace(identity={"path": folder}),  # type: ignore[arg-type]
        )
        ctx.use_build(result, ok, "using it")
        records = list(layout.users_dir("a" * 64).glob("*.json")) if not dry_run else []
        assert layout.users_dir("a" * 64).exists() is (not dry_run)
    assert [json.loads(r.read_text()) for r in records] == [{"path": folder}]


def test_a_missing_cache_is_reported(tmp_path: Path) -> None:
    result = run("cache", "list", "--cache-dir", str(tmp_path / "none"))
    assert result.exit_code == 0
    assert "no build cache at" in result.output and "qwen-kvprep fix DIR" in result.output
