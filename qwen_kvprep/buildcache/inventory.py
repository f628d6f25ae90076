"""What the build cache holds, who uses each build, and pruning what nobody uses.

The cache does not know by itself which prepared folders load a build, so fix records it:
`<cache>/users/<key>/<id>.json` holds `{"path": DIR}` (the id is the hash of DIR, as in a
modules-cache folder's `.qwen-kvprep-users/`). A record is only a claim: a folder counts
as a user only while its own `DIR/.qwen-kvprep/state.json` names this very build (or while
its folder lock is held: a fix is preparing it right now), so records of folders since
deleted, reverted or prepared with another build keep nothing alive. "This very build" is
its key in this cache, the cache named by its marker's id (buildcache/marker.py), not by
a path: a cache reached by a bind mount or moved elsewhere is still the same cache.

Pruning works only in a folder that is a build cache (marker.py), never follows a link,
never leaves the cache root, and removes a build only while holding its build lock (taken
without waiting): a build being compiled or installed is left alone. A build leaves
builds/ by one rename into tmp/, so a reader sees it whole or not at all; one that another
prune removed first is taken as gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import filelock

from qwen_kvprep.buildcache.lock import build_lock
from qwen_kvprep.buildcache.manifest import MANIFEST, read_manifest
from qwen_kvprep.buildcache.marker import claim, identify, refuse
from qwen_kvprep.buildcache.paths import CacheLayout, not_writable, resolve_cache_dir
from qwen_kvprep.common import LOCK_FILE, STATE_DIRNAME, user_record_name
from qwen_kvprep.errors import CacheError, LockTimeout, UsageError
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


def register_user(
    layout: CacheLayout, key: str, prepared: str
) -> tuple[Optional[str], bool]:
    """Record that the prepared folder `prepared` (absolute) uses build `key`, once: a fix
    that changes nothing writes nothing, so the record's time is when the folder first
    chose the build. Returns the cache's id (None when it has none) and whether the
    record was written now (False: it was there already, or cannot be). A cache this process
    cannot write (a shared read-only one) keeps no record: `cache prune --keep KEY` is how
    its users are counted."""
    try:
        cache_id = claim(layout.root)
    except (OSError, CacheError):
        with contextlib.suppress(CacheError):
            return identify(layout.root).cache_id, False
        return None, False
    folder = layout.users_dir(key)
    record = folder / user_record_name(prepared)
    text = json.dumps({"path": prepared})
    with contextlib.suppress(OSError, ValueError):
        if read_regular(record, 1 << 16).decode("utf-8") == text:
            return cache_id, False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(record, text)
    except OSError:
        return cache_id, False
    return cache_id, True


def hold_build(
    layout: CacheLayout, key: str, so_sha256: str, prepared: str, timeout: float
) -> tuple[bool, Optional[str]]:
    """Record that `prepared` uses build `key`, then check under the build's lock that the
    build is still there with this library: (whether it is, the cache's id). Once this
    says yes, a prune sees the record under that same lock (the folder's lock being held
    by the caller, or its state naming the build), so the build cannot go between a fix
    choosing it and recording it. A cache whose lock cannot be taken (read only) cannot be
    pruned by this user either: the build counts as held. A record that was there already
    kept the build from any prune since the caller took its folder lock (and the folder's
    state usually names the build too), so it is only looked at, without the lock: a fix
    that changes nothing writes nothing in the cache, not even a lock file."""
    cache_id, written = register_user(layout, key, prepared)
    if not written:
        return _intact(layout, key, so_sha256), cache_id
    try:
        identify(layout.root)  # no lock file is made through a linked locks/
        # a lock file that cannot be made: a read-only cache (filelock would wait it out)
        os.close(os.open(layout.lock_path(key), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644))
    except (OSError, CacheError):
        return True, cache_id
    try:
        with build_lock(layout, key, timeout, lambda _: None):
            manifest = read_manifest(layout.build_dir(key))
    except OSError:
        return True, cache_id
    return _intact(layout, key, so_sha256, manifest), cache_id


def _intact(
    layout: CacheLayout, key: str, so_sha256: str, manifest: Optional[Manifest] = None
) -> bool:
    """Whether build `key` is still published with the library of this sha256."""
    manifest = manifest or read_manifest(layout.build_dir(key))
    return (
        manifest is not None
        and manifest.get("so_sha256") == so_sha256
        and (layout.build_dir(key) / manifest["so"]).is_file()
    )


def _points_at(prepared: str, build_dir: Path, key: str, cache_id: Optional[str]) -> bool:
    """Whether the folder's state names build `key` of this cache: by the cache's id when
    both record one (any path may reach the cache), else by the build's real path (a
    state written before the cache had an id)."""
    state, _ = read_state(prepared)
    build = state.get("build") if state else None
    if not build or build["key"] != key:
        return False
    recorded = build.get("cache_id")
    if recorded is not None and cache_id is not None:
        return recorded == cache_id
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
    kept_by_option: bool = False  # named by `cache prune --keep`
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
    cache_id: Optional[str]
    builds: list[Build]
    leftovers: list[Leftover]

    @property
    def total(self) -> int:
        return sum(b.size for b in self.builds) + sum(x.size for x in self.leftovers)

    def to_json(self) -> JSONObject:
        return {
            "root": str(self.layout.root),
            "exists": self.exists,
            "id": self.cache_id,
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


def read_users(layout: CacheLayout, build: Build, cache_id: Optional[str]) -> None:
    """Fill in who uses `build`, checking each record against the folder's own state."""
    build.users, build.being_prepared, build.stale = [], [], []
    for record, prepared in read_records(layout.users_dir(build.key)):
        with contextlib.suppress(OSError):
            when = os.lstat(record).st_mtime
            build.last_chosen = max(build.last_chosen or when, when)
        if _points_at(prepared, build.dir, build.key, cache_id):
            build.users.append(prepared)
        elif _being_prepared(prepared):
            build.being_prepared.append(prepared)
        else:
            build.stale.append(record)


def take_inventory(layout: CacheLayout) -> Inventory:
    """Every entry of builds/ (a link or a file there is not a build and is not listed),
    and what tmp/ and logs/ hold. Reads only; creates nothing. NotACache when the folder
    is not a build cache (marker.py)."""
    found = identify(layout.root)
    if not found.exists:
        return Inventory(layout, False, None, [], [])
    builds: list[Build] = []
    for name, st in _entries(layout.builds):
        if not stat.S_ISDIR(st.st_mode):
            continue
        folder = layout.build_dir(name)
        manifest = read_manifest(folder)
        build = Build(name, folder, _origin(manifest), tree_size(folder), manifest)
        build.locked = _held(layout.lock_path(name))
        read_users(layout, build, found.cache_id)
        builds.append(build)
    now = time.time()
    leftovers: list[Leftover] = []
    for kind, folder in (("tmp", layout.tmp), ("log", layout.logs)):
        for name, st in _entries(folder):
            item = Leftover(folder / name, kind, tree_size(folder / name), now - st.st_mtime)
            if kind == "tmp":
                item.locked = _held(layout.lock_path(name.split(".")[0]))
            leftovers.append(item)
    return Inventory(layout, True, found.cache_id, builds, leftovers)


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
    if build.kept_by_option:
        return "named by --keep"
    if build.locked:
        return "its build lock is held (being built or installed)"
    if build.users:
        return "used by " + ", ".join(build.users)
    if build.being_prepared:
        return "being prepared now: " + ", ".join(build.being_prepared)
    return None


def _gone_already(function: object, path: str, exc_info: object) -> None:
    """rmtree's error handler: what another prune removed first is gone, as wanted."""
    exc = exc_info[1] if isinstance(exc_info, tuple) else exc_info
    if not isinstance(exc, FileNotFoundError):
        raise exc if isinstance(exc, BaseException) else OSError(path)


def _remove_tree(layout: CacheLayout, path: Path) -> None:
    """Remove `path` (inside the cache root; a link itself, never what it points to)."""
    root = os.path.realpath(layout.root)
    parent = os.path.realpath(path.parent)
    if os.path.commonpath([root, parent]) != root:
        # the cache's folders were checked before: one was swapped for a link since
        raise refuse(layout.root, f"{path.parent} now leads outside it", path.parent)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, onerror=_gone_already)  # links inside: removed, never followed
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


GONE = "removed by another prune meanwhile"


class BuildVanished(CacheError):
    """The build a fix chose was removed (by `cache prune`) before its use was recorded."""


def vanished(build_dir: Path) -> BuildVanished:
    message = f"the build {build_dir} was removed (by `qwen-kvprep cache prune`?) as it was chosen"
    return BuildVanished.failing("build.build", message, "run the same command again", [build_dir])


def _remove_build(layout: CacheLayout, build: Build, cache_id: Optional[str]) -> Optional[str]:
    """Remove an unused build under its lock; why not, when it turned out in use (GONE:
    another prune removed it first)."""
    try:
        with build_lock(layout, build.key, 0, lambda _: None):
            # a fix may have registered since the inventory
            read_users(layout, build, cache_id)
            if build.used:
                return _why_kept(build)
            # one rename takes it out of builds/: no reader ever sees half of it
            gone = layout.tmp / f"{build.key}.pruned.{os.getpid()}"
            layout.tmp.mkdir(exist_ok=True)
            try:
                os.rename(build.dir, gone)
            except FileNotFoundError:
                return GONE
            _remove_tree(layout, gone)
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


def matching_keys(keys: Sequence[str], builds: Sequence[Build]) -> set[str]:
    """The builds `cache prune --keep` names: a whole key, or a prefix of one of at least
    12 characters (as `cache list` shows them). A name that matches no build, or several,
    is a usage error: a typo must not let prune remove what it was meant to keep."""
    out: set[str] = set()
    for wanted in keys:
        found = [b.key for b in builds if len(wanted) >= 12 and b.key.startswith(wanted)]
        if len(found) != 1:
            what = "no build" if not found else f"{len(found)} builds"
            raise UsageError(
                f"--keep {wanted}: matches {what} in the cache (a key, or its first 12 or "
                "more characters, as `qwen-kvprep cache list` shows them)",
                fix="qwen-kvprep cache list",
            )
        out.update(found)
    return out


def prune(layout: CacheLayout, dry_run: bool = False, keep: Sequence[str] = ()) -> PruneResult:
    """Remove the builds no prepared folder uses, stale user records, leftovers of killed
    runs in tmp/ and logs older than LOG_AGE. `dry_run`: only say what would go. `keep`:
    keys (or 12+ character prefixes) of builds kept whoever uses them (users whose use
    leaves no record: a read-only cache, a folder not visible from here)."""
    inventory = take_inventory(layout)
    result = PruneResult(inventory, dry_run)
    if not inventory.exists:
        return result
    kept = matching_keys(keep, inventory.builds)
    for build in inventory.builds:
        build.kept_by_option = build.key in kept
    if not dry_run:
        try:
            # a cache of a version before the marker gets one (take_inventory checked
            # that it holds nothing but a cache's own files)
            inventory.cache_id = claim(layout.root)
        except OSError as exc:
            raise not_writable(layout.root, exc) from exc
        _check_writable(layout)
    for build in inventory.builds:
        why = _why_kept(build)
        if why is None and not dry_run:
            why = _remove_build(layout, build, inventory.cache_id)
            if why == GONE:
                continue
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
