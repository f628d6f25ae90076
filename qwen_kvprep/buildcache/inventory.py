"""What the build cache holds, who uses each build, and pruning what nobody uses.

The cache does not know by itself which prepared folders load a build, so fix records it:
`<cache>/users/<key>/<id>.json` holds `{"path": DIR}` (the id is the hash of DIR, as in a
modules-cache folder's `.qwen-kvprep-users/`). A record is only a claim: a folder counts
as a user only while its own `DIR/.qwen-kvprep/state.json` names this very build (or while
its folder lock is held: a fix is preparing it right now), so records of folders since
deleted, reverted or prepared with another build keep nothing alive.

Pruning never follows a link, never leaves the cache root, and removes a build only while
holding its build lock (taken without waiting): a build being compiled or installed is
left alone. A build leaves builds/ by one rename into tmp/, so a reader sees it whole or
not at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import filelock

from qwen_kvprep.buildcache.lock import build_lock
from qwen_kvprep.buildcache.manifest import MANIFEST, read_manifest
from qwen_kvprep.buildcache.paths import CacheLayout, not_writable, resolve_cache_dir
from qwen_kvprep.common import LOCK_FILE, STATE_DIRNAME, user_record_name
from qwen_kvprep.errors import LockTimeout
from qwen_kvprep.fsutil import atomic_write_text
from qwen_kvprep.probe.revertplan import read_records
from qwen_kvprep.state.reader import read_state
from qwen_kvprep.untrusted import read_regular

if TYPE_CHECKING:
    from qwen_kvprep.buildcache.manifest import Manifest
    from qwen_kvprep.jsontypes import JSONObject

OLD = "old"  # a manifest without an origin: made by an older version, it serves nobody
UNREADABLE = "unreadable"  # no manifest this version can read
# tmp/ entries older than this whose build lock is free are leftovers of killed runs
TMP_AGE = 3600.0
# logs of failed builds are kept this long (they are what a bug report needs)
LOG_AGE = 7 * 86400.0


def layout_for(option: Optional[str]) -> CacheLayout:
    """The build cache of `--cache-dir` (None: the environment's, as every command)."""
    return CacheLayout(resolve_cache_dir(Path(option) if option else None))


def register_user(layout: CacheLayout, key: str, prepared: str) -> None:
    """Record that the prepared folder `prepared` (absolute) uses build `key`, once: a fix
    that changes nothing writes nothing, so the record's time is when the folder first
    chose the build. A cache this process cannot write (a shared read-only one) keeps no
    record: the build is then never pruned by this user anyway."""
    folder = layout.users_dir(key)
    record = folder / user_record_name(prepared)
    text = json.dumps({"path": prepared})
    with contextlib.suppress(OSError, ValueError):
        if read_regular(record, 1 << 16).decode("utf-8") == text:
            return
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(record, text)


def _points_at(prepared: str, build_dir: Path, key: str) -> bool:
    state, _ = read_state(prepared)
    build = state.get("build") if state else None
    if not build or build["key"] != key:
        return False
    return os.path.realpath(build["dir"]) == os.path.realpath(build_dir)


def _being_prepared(prepared: str) -> bool:
    """Whether a fix, prestart or revert holds the folder's lock right now."""
    path = Path(prepared) / STATE_DIRNAME / LOCK_FILE
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    return _held(path)


def _held(path: Path) -> bool:
    """Whether another process holds the lock file `path` (which exists: nothing made)."""
    if not path.is_file() or path.is_symlink():
        return False
    lock = filelock.FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return True
    except OSError:
        return False
    lock.release()
    return False


def tree_size(path: Path) -> int:
    """Bytes on disk under `path`, links not followed."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    for top, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                entry = os.lstat(os.path.join(top, name))
                total += 0 if stat.S_ISDIR(entry.st_mode) else entry.st_size
    return total


@dataclass
class Build:
    key: str
    dir: Path
    origin: str  # compiled, prebuilt, OLD or UNREADABLE
    size: int
    manifest: Optional[Manifest] = None
    users: list[str] = field(default_factory=list)  # verified prepared folders
    being_prepared: list[str] = field(default_factory=list)  # recorded, folder lock held
    stale: list[Path] = field(default_factory=list)  # records that no longer hold
    last_chosen: Optional[float] = None  # newest record's time: a folder first chose it then
    locked: bool = False

    @property
    def used(self) -> bool:
        return bool(self.users or self.being_prepared)

    def to_json(self) -> JSONObject:
        inputs = self.manifest["inputs"] if self.manifest else None
        return {
            "key": self.key,
            "dir": str(self.dir),
            "origin": self.origin,
            "source": self.manifest.get("source") if self.manifest else None,
            "torch": inputs["torch"] if inputs else None,
            "torch_cuda": inputs["torch_cuda"] if inputs else None,
            "python_tag": inputs["python_tag"] if inputs else None,
            "size": self.size,
            "created": self.manifest.get("created") if self.manifest else None,
            "last_chosen": _iso(self.last_chosen),
            "users": list(self.users),
            "being_prepared": list(self.being_prepared),
            "locked": self.locked,
        }


@dataclass
class Leftover:
    path: Path
    kind: str  # "tmp" or "log"
    size: int
    age: float  # seconds since last modified
    locked: bool = False  # tmp/: its key's build lock is held (a build in progress)

    def to_json(self) -> JSONObject:
        return {"path": str(self.path), "kind": self.kind, "size": self.size,
                "age_seconds": round(self.age), "locked": self.locked}


@dataclass
class Inventory:
    layout: CacheLayout
    exists: bool
    builds: list[Build]
    leftovers: list[Leftover]

    @property
    def total(self) -> int:
        return sum(b.size for b in self.builds) + sum(x.size for x in self.leftovers)

    def to_json(self) -> JSONObject:
        return {
            "root": str(self.layout.root),
            "exists": self.exists,
            "builds": [b.to_json() for b in self.builds],
            "leftovers": [x.to_json() for x in self.leftovers],
            "total_size": self.total,
        }


def _iso(when: Optional[float]) -> Optional[str]:
    if when is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))


def _entries(folder: Path) -> Iterator[tuple[str, os.stat_result]]:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            yield name, os.lstat(folder / name)


def _origin(manifest: Optional[Manifest]) -> str:
    if manifest is None:
        return UNREADABLE
    return manifest.get("origin", OLD)


def read_users(layout: CacheLayout, build: Build) -> None:
    """Fill in who uses `build`, checking each record against the folder's own state."""
    build.users, build.being_prepared, build.stale = [], [], []
    for record, prepared in read_records(layout.users_dir(build.key)):
        with contextlib.suppress(OSError):
            when = os.lstat(record).st_mtime
            build.last_chosen = max(build.last_chosen or when, when)
        if _points_at(prepared, build.dir, build.key):
            build.users.append(prepared)
        elif _being_prepared(prepared):
            build.being_prepared.append(prepared)
        else:
            build.stale.append(record)


def take_inventory(layout: CacheLayout) -> Inventory:
    """Every entry of builds/ (a link or a file there is not a build and is not listed),
    and what tmp/ and logs/ hold. Reads only; creates nothing."""
    builds: list[Build] = []
    for name, st in _entries(layout.builds):
        if not stat.S_ISDIR(st.st_mode):
            continue
        folder = layout.build_dir(name)
        manifest = read_manifest(folder)
        build = Build(name, folder, _origin(manifest), tree_size(folder), manifest)
        build.locked = _held(layout.lock_path(name))
        read_users(layout, build)
        builds.append(build)
    now = time.time()
    leftovers: list[Leftover] = []
    for kind, folder in (("tmp", layout.tmp), ("log", layout.logs)):
        for name, st in _entries(folder):
            item = Leftover(folder / name, kind, tree_size(folder / name), now - st.st_mtime)
            if kind == "tmp":
                item.locked = _held(layout.lock_path(name.split(".")[0]))
            leftovers.append(item)
    return Inventory(layout, layout.root.is_dir(), builds, leftovers)


@dataclass
class PruneResult:
    inventory: Inventory
    dry_run: bool
    removed: list[tuple[str, Path, int, str]] = field(default_factory=list)  # kind, path, size, why
    kept: list[tuple[str, str]] = field(default_factory=list)  # key, why

    @property
    def freed(self) -> int:
        return sum(size for _, _, size, _ in self.removed)

    def to_json(self) -> JSONObject:
        return {
            "root": str(self.inventory.layout.root),
            "dry_run": self.dry_run,
            "removed": [
                {"kind": k, "path": str(p), "size": s, "reason": why}
                for k, p, s, why in self.removed
            ],
            "kept": [{"key": key, "reason": why} for key, why in self.kept],
            "freed": self.freed,
        }


def _why_unused(build: Build) -> str:
    if build.origin == OLD:
        return "made by an older version of qwen-kvprep (serves nobody)"
    if build.origin == UNREADABLE:
        return f"no {MANIFEST} this version can read"
    return "no prepared folder uses it"


def _why_kept(build: Build) -> Optional[str]:
    if build.locked:
        return "its build lock is held (being built or installed)"
    if build.users:
        return "used by " + ", ".join(build.users)
    if build.being_prepared:
        return "being prepared now: " + ", ".join(build.being_prepared)
    return None


def _remove_tree(layout: CacheLayout, path: Path) -> None:
    """Remove `path` (inside the cache root; a link itself, never what it points to)."""
    root = os.path.realpath(layout.root)
    parent = os.path.realpath(path.parent)
    if os.path.commonpath([root, parent]) != root:
        raise ValueError(f"{path} is not inside the build cache {layout.root}")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)  # rmtree removes links inside, never their targets
    else:
        os.unlink(path)


def _remove_build(layout: CacheLayout, build: Build) -> Optional[str]:
    """Remove an unused build under its lock; why not, when it turned out in use."""
    try:
        with build_lock(layout, build.key, 0, lambda _: None):
            read_users(layout, build)  # a fix may have registered since the inventory
            if build.used:
                return _why_kept(build)
            # one rename takes it out of builds/: no reader ever sees half of it
            gone = layout.tmp / f"{build.key}.pruned.{os.getpid()}"
            layout.tmp.mkdir(exist_ok=True)
            os.rename(build.dir, gone)
            _remove_tree(layout, gone)
            if layout.users_dir(build.key).is_dir():
                _remove_tree(layout, layout.users_dir(build.key))
    except LockTimeout:
        build.locked = True
        return _why_kept(build)
    except OSError as exc:
        raise not_writable(layout.root, exc) from exc
    return None


def _check_writable(layout: CacheLayout) -> None:
    for folder in (layout.root, layout.builds):
        probe = folder / f".prune-test.{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise not_writable(layout.root, exc) from exc


def prune(layout: CacheLayout, dry_run: bool = False) -> PruneResult:
    """Remove the builds no prepared folder uses, stale user records, leftovers of killed
    runs in tmp/ and logs older than LOG_AGE. `dry_run`: only say what would go."""
    inventory = take_inventory(layout)
    result = PruneResult(inventory, dry_run)
    if not inventory.exists:
        return result
    if not dry_run:
        _check_writable(layout)
    for build in inventory.builds:
        why = _why_kept(build)
        if why is None and not dry_run:
            why = _remove_build(layout, build)
        if why is not None:
            result.kept.append((build.key, why))
            for record in build.stale:
                if not dry_run:
                    with contextlib.suppress(OSError):
                        os.unlink(record)
            continue
        result.removed.append(("build", build.dir, build.size, _why_unused(build)))
    listed = {b.key for b in inventory.builds}
    for name, st in _entries(layout.users):
        # the records of a build that is gone (removed by hand, or by an older prune)
        if name not in listed and stat.S_ISDIR(st.st_mode) and not dry_run:
            with contextlib.suppress(OSError):
                _remove_tree(layout, layout.users_dir(name))
    for item in inventory.leftovers:
        limit = TMP_AGE if item.kind == "tmp" else LOG_AGE
        if item.locked or item.age < limit:
            continue
        if not dry_run:
            try:
                _remove_tree(layout, item.path)
            except FileNotFoundError:
                continue
        why = "left by a run that ended" if item.kind == "tmp" else "an old log"
        result.removed.append((item.kind, item.path, item.size, why))
    return result


# -- text ------------------------------------------------------------------------------
def human_size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    value = n / 1000
    for unit in ("kB", "MB"):
        if value < 1000:
            return f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def _origin_text(build: Build) -> str:
    source = build.manifest.get("source") if build.manifest else None
    return f"{build.origin} {source}" if source else build.origin


def _abi_text(build: Build) -> str:
    if build.manifest is None:
        return "?"
    inputs = build.manifest["inputs"]
    cuda = f"CUDA {inputs['torch_cuda']}" if inputs["torch_cuda"] else "CPU"
    return f"torch {inputs['torch']}, {cuda}, {inputs['python_tag']}"


def inventory_text(inventory: Inventory) -> str:
    root = inventory.layout.root
    if not inventory.exists:
        return (
            f"no build cache at {root} yet: `qwen-kvprep fix DIR` or `qwen-kvprep build` "
            "creates it (another folder: --cache-dir DIR or $QWEN_KVPREP_CACHE)"
        )
    lines = [f"build cache {root}"]
    for b in inventory.builds:
        created = (b.manifest.get("created") or "?")[:10] if b.manifest else "?"
        used = _iso(b.last_chosen)
        lines.append(
            f"  {b.key[:12]}  {_origin_text(b)}  {_abi_text(b)}  {human_size(b.size)}  "
            f"created {created}" + (f", last chosen {used[:10]}" if used else "")
            + ("  [locked: being built or installed]" if b.locked else "")
        )
        users = [*b.users, *(f"{p} (being prepared)" for p in b.being_prepared)]
        lines += [f"      used by {p}" for p in users] or ["      used by no prepared folder"]
    for x in inventory.leftovers:
        lines.append(f"  {x.kind}: {x.path} ({human_size(x.size)})")
    n = len(inventory.builds)
    lines.append(
        f"{n} build{'s' * (n != 1)}, {len(inventory.leftovers)} leftover(s) in tmp/ and "
        f"logs/, {human_size(inventory.total)} in all"
    )
    return "\n".join(lines)


def prune_text(result: PruneResult) -> str:
    if not result.inventory.exists:
        return f"no build cache at {result.inventory.layout.root}: nothing to prune"
    verb = "would remove" if result.dry_run else "removed"
    lines = [f"{verb} {kind} {path} ({human_size(size)}): {why}"
             for kind, path, size, why in result.removed]
    lines += [f"kept build {key[:12]}: {why}" for key, why in result.kept]
    freed = "would free" if result.dry_run else "freed"
    lines.append(f"{freed} {human_size(result.freed)} in {result.inventory.layout.root}")
    return "\n".join(lines)
