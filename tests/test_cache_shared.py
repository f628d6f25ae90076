"""The build cache as a shared place: links planted in it, folders that are not caches,
the same cache reached by another path, and concurrent prunes and fixes. Nothing outside
the cache is touched, and a build in use is never removed."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qwen_kvprep.buildcache import inventory
from qwen_kvprep.buildcache.inventory import BuildVanished, prune
from qwen_kvprep.buildcache.marker import MARKER, NotACache, claim, identify
from qwen_kvprep.buildcache.paths import CacheLayout
from qwen_kvprep.tiny import generate_checkpoint
from tests.test_cache_cmd import prepared, publish, run

KEY = "b" * 64


@pytest.fixture()
def layout(tmp_path: Path) -> CacheLayout:
    cache = CacheLayout(tmp_path / "cache")
    claim(cache.root)
    return cache


def user_files(tmp_path: Path) -> Path:
    """Someone's folder outside the cache, with files that must survive."""
    outside = tmp_path / "project"
    (outside / "src").mkdir(parents=True)
    (outside / "src" / "main.c").write_text("int main(void) { return 0; }\n")
    (outside / "photos").mkdir()
    (outside / "photos" / "a.jpg").write_bytes(b"\xff\xd8jpeg")
    old = time.time() - 30 * 86400
    for path in (outside / "src" / "main.c", outside / "photos" / "a.jpg", outside):
        os.utime(path, (old, old))
    return outside


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_prune_refuses_a_builds_folder_that_is_a_link(tmp_path: Path, layout: CacheLayout) -> None:
    outside = user_files(tmp_path)
    before = tree(outside)
    layout.builds.symlink_to(outside)
    for args in ((), ("--json",), ("--dry-run",)):
        result = run("cache", "prune", "--cache-dir", str(layout.root), *args)
        assert result.exit_code == 1, result.output
        assert f"{layout.builds} is a symbolic link" in result.output
        assert "internal error" not in result.output and "Traceback" not in result.output
    assert tree(outside) == before
    assert layout.builds.is_symlink()


def test_prune_and_list_refuse_a_folder_that_is_not_a_cache(tmp_path: Path) -> None:
    myapp = tmp_path / "myapp"
    (myapp / "builds" / "release-1.2").mkdir(parents=True)
    (myapp / "builds" / "release-1.2" / "app.tar").write_bytes(b"release")
    (myapp / "tmp").mkdir()
    (myapp / "tmp" / "upload.part").write_bytes(b"part")
    (myapp / "logs").mkdir()
    (myapp / "logs" / "audit-2024.log").write_text("audit\n")
    old = time.time() - 30 * 86400
    for path in myapp.rglob("*"):
        os.utime(path, (old, old))
    before = tree(myapp)
    for command in (("cache", "prune"), ("cache", "prune", "--dry-run"), ("cache", "list")):
        result = run(*command, "--cache-dir", str(myapp))
        assert result.exit_code == 1, result.output
        assert f"{myapp} is not a qwen-kvprep build cache" in result.output
        assert MARKER in result.output and "--cache-dir" in result.output
    assert tree(myapp) == before  # no locks/, no marker, nothing removed


def test_build_refuses_to_make_a_cache_in_a_folder_of_someone_elses(tmp_path: Path) -> None:
    myapp = tmp_path / "myapp"
    (myapp / "src").mkdir(parents=True)
    with pytest.raises(NotACache):
        CacheLayout(myapp).ensure_writable()
    assert tree(myapp) == ["src"]


def test_a_new_or_empty_folder_becomes_a_marked_cache(tmp_path: Path) -> None:
    for root in (tmp_path / "new" / "cache", tmp_path / "empty"):
        root.parent.mkdir(parents=True, exist_ok=True)
        if root.name == "empty":
            root.mkdir()
        cache_id = CacheLayout(root).ensure_writable()
        assert identify(root).cache_id == cache_id
        assert CacheLayout(root).ensure_writable() == cache_id  # one id for good


def test_a_cache_of_a_version_before_the_marker_is_adopted(tmp_path: Path) -> None:
    old = CacheLayout(tmp_path / "cache")
    publish(old, "a" * 64)
    publish(old, KEY)
    prepared(tmp_path, "model", old, "a" * 64)
    (old.root / MARKER).unlink()  # register_user marked it: as an older version, none
    old.locks.mkdir()
    (old.locks / f"{KEY}.lock").write_text("")
    old.logs.mkdir()
    (old.logs / f"{KEY}-20250101T000000-12.log").write_text("failed")
    assert not (old.root / MARKER).exists()
    assert "would remove build" in run("cache", "prune", "--dry-run", "--cache-dir",
                                       str(old.root)).output
    assert not (old.root / MARKER).exists()  # a dry run writes nothing
    result = run("cache", "prune", "--cache-dir", str(old.root))
    assert result.exit_code == 0, result.output
    assert identify(old.root).cache_id is not None
    assert old.build_dir("a" * 64).is_dir() and not old.build_dir(KEY).exists()
    # one file an older version does not write and it is no longer taken for a cache
    (old.root / MARKER).unlink()
    (old.root / "notes.txt").write_text("mine")
    assert run("cache", "prune", "--cache-dir", str(old.root)).exit_code == 1


@pytest.mark.parametrize("folder", ["tmp", "logs", "users", "locks"])
def test_prune_refuses_cache_folders_linked_elsewhere(
    tmp_path: Path, layout: CacheLayout, folder: str
) -> None:
    publish(layout, KEY)
    outside = user_files(tmp_path)
    before = tree(outside)
    (layout.root / folder).symlink_to(outside)
    result = run("cache", "prune", "--cache-dir", str(layout.root), "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.output)  # stays valid JSON
    assert any(f"{layout.root / folder} is a symbolic link" in f["message"]
               for f in doc["findings"])
    assert "internal error" not in result.output
    assert tree(outside) == before
    assert layout.build_dir(KEY).is_dir()
    assert run("cache", "list", "--cache-dir", str(layout.root)).exit_code == 1


def test_a_build_another_prune_removed_first_is_taken_as_gone(
    layout: CacheLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(layout, KEY)
    publish(layout, "c" * 64)
    real = inventory.read_users
    seen: list[str] = []

    def other_prune_was_faster(lay: CacheLayout, build: Any, cache_id: Any) -> None:
        real(lay, build, cache_id)
        seen.append(build.key)
        if seen.count(KEY) == 2:  # under the build lock, after the inventory saw it
            shutil.rmtree(build.dir)

    monkeypatch.setattr(inventory, "read_users", other_prune_was_faster)
    result = run("cache", "prune", "--cache-dir", str(layout.root))
    assert result.exit_code == 0, result.output
    assert "not writable" not in result.output
    assert not layout.build_dir("c" * 64).exists()


@pytest.mark.parametrize("what", ["fifo", "devnull", "file"])
def test_list_on_something_that_is_not_a_folder(
    tmp_path: Path, what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--cache-dir naming anything but a folder is one mistake, with one exit code: a
    usage error (2), as click makes it for a regular file."""
    if what == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    elif what == "file":
        path = tmp_path / "hostname"
        path.write_text("x\n")
    else:
        path = Path(os.devnull)
    for command in (("cache", "list"), ("cache", "prune")):
        result = run(*command, "--cache-dir", str(path))
        assert result.exit_code == 2, result.output
        assert "not a folder" in result.output or "is a file" in result.output
        assert "no build cache" not in result.output
    # through the variable the library judges it: the same usage error (2), naming what it
    # is, for every command that reads it (prestart's click reads it as the option)
    monkeypatch.setenv("QWEN_KVPREP_CACHE", str(path))
    ckpt = generate_checkpoint(tmp_path / "ckpt", layers=1, heads=2, head_dim=16, shards=1)
    for command in (("cache", "list"), ("fix", "--dry-run", str(ckpt)),
                    ("prestart", str(ckpt), "--", "true")):
        result = run(*command)
        assert result.exit_code == 2, (command, result.output)
        assert "not a folder" in result.output, result.output


def state_with_cache_id(folder: str, cache_id: str) -> None:
    path = Path(folder) / ".qwen-kvprep" / "state.json"
    state = json.loads(path.read_text())
    state["build"]["cache_id"] = cache_id
    path.write_text(json.dumps(state))


def test_a_cache_reached_by_another_path_keeps_the_builds_in_use(tmp_path: Path) -> None:
    """The prepared folder recorded the cache as /pod/cache (a bind mount in a pod);
    prune runs on the host, where the same disk is /host/cache."""
    pod = CacheLayout(tmp_path / "pod" / "cache")
    cache_id = claim(pod.root)
    publish(pod, KEY)
    user = prepared(tmp_path, "model", pod, KEY)
    state_with_cache_id(user, cache_id)
    host = CacheLayout(tmp_path / "host" / "cache")
    host.root.parent.mkdir()
    os.rename(pod.root, host.root)
    result = prune(host)
    assert host.build_dir(KEY).is_dir()
    assert result.kept == [(KEY, f"used by {user}")]


def test_a_state_of_another_cache_does_not_keep_a_build(
    tmp_path: Path, layout: CacheLayout
) -> None:
    publish(layout, KEY)
    user = prepared(tmp_path, "model", layout, KEY)
    state_with_cache_id(user, "0" * 32)  # the same key, in another cache
    prune(layout)
    assert not layout.build_dir(KEY).exists()


def test_keep_names_builds_whose_users_leave_no_record(layout: CacheLayout) -> None:
    publish(layout, KEY)
    publish(layout, "c" * 64)
    result = run("cache", "prune", "--cache-dir", str(layout.root), "--keep", KEY[:12])
    assert result.exit_code == 0, result.output
    assert layout.build_dir(KEY).is_dir() and not layout.build_dir("c" * 64).exists()
    assert "named by --keep" in result.output
    for typo in ("d" * 12, "b" * 6):
        bad = run("cache", "prune", "--cache-dir", str(layout.root), "--keep", typo)
        assert bad.exit_code == 2 and "--keep" in bad.output
    assert layout.build_dir(KEY).is_dir()


def fix_context(folder: str) -> Any:
    from qwen_kvprep.steps.context import FixContext

    return FixContext(
        Path(folder),
        options=SimpleNamespace(dry_run=False),  # type: ignore[arg-type]
        journal=SimpleNamespace(identity={"path": folder}),  # type: ignore[arg-type]
    )


def chosen(build: Path) -> Any:
    manifest = json.loads((build / "manifest.json").read_text())
    return SimpleNamespace(key=build.name, dir=build, to_json=dict, manifest=manifest)


def test_a_build_pruned_between_its_choice_and_its_record_is_noticed(
    tmp_path: Path, layout: CacheLayout
) -> None:
    from qwen_kvprep.findings import ok

    build = publish(layout, KEY)
    result = chosen(build)  # fix found it in the cache...
    prune(layout)  # ...a prune removed it before fix recorded its use
    with pytest.raises(BuildVanished):
        fix_context(str(tmp_path / "model")).use_build(result, ok, "using it")


def test_a_held_build_records_the_cache_id_for_the_state(
    tmp_path: Path, layout: CacheLayout
) -> None:
    from qwen_kvprep.findings import ok
    from qwen_kvprep.steps.record import _build

    build = publish(layout, KEY)
    ctx = fix_context(str(tmp_path / "model"))
    ctx.use_build(chosen(build), ok, "using it")
    ctx.build = SimpleNamespace(key=KEY, dir=build, so=build / "cache_autogptq_cuda_256.so",
                                cuda=True, arch_list=["9.0"], manifest=chosen(build).manifest)
    assert _build(ctx)["cache_id"] == identify(layout.root).cache_id  # type: ignore[index]


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "abc", "1e999"])
def test_an_unreadable_lock_timeout_is_refused_naming_the_variable(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qwen_kvprep.buildcache.lock import lock_timeout
    from qwen_kvprep.errors import UsageError

    monkeypatch.setenv("QWEN_KVPREP_LOCK_TIMEOUT", raw)
    with pytest.raises(UsageError, match=f"QWEN_KVPREP_LOCK_TIMEOUT='{raw}' is not a number"):
        lock_timeout()
    monkeypatch.setenv("QWEN_KVPREP_LOCK_TIMEOUT", " 2.5 ")
    assert lock_timeout() == 2.5


@pytest.mark.parametrize("raw", ["nan", "1e309", "-1", "soon"])
def test_an_unreadable_lock_timeout_option_is_refused(tmp_path: Path, raw: str) -> None:
    result = run("build", "--cache-dir", str(tmp_path / "c"), "--lock-timeout", raw)
    assert result.exit_code == 2, result.output
    assert f"--lock-timeout='{raw}' is not a number of seconds" in result.output
    assert not (tmp_path / "c").exists()
