"""Which folders are build caches: the marker qwen-kvprep writes when it makes one.

A build cache is a shared place (a typo in `--cache-dir`, a wrong `QWEN_KVPREP_CACHE`, a
link planted by someone else), so nothing that removes or writes there trusts a path
alone. `<cache>/.qwen-kvprep-cache.json` (`{"qwen_kvprep_cache": 1, "id": HEX}`) is
written when qwen-kvprep first writes into a folder; its id names the cache whatever path
reaches it (a bind mount, the same disk mounted elsewhere, a moved folder), which is how a
prepared folder's state says which cache its build is in.

A folder without the marker is taken for a cache (and given one when written to) only
when it is empty or holds nothing but what qwen-kvprep itself writes there, by name and
kind (the caches of versions before the marker); anything else is refused, and so is any
of the cache's own folders that is a symbolic link or not a folder. The cache root itself
may be a link: whoever named it chose it. Nothing below it is followed.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep.common import ENV_CACHE
from qwen_kvprep.errors import EXIT_USAGE, CacheError
from qwen_kvprep.fsutil import fsync_dir
from qwen_kvprep.untrusted import kind_of, read_record

CACHE_OPTION = "--cache-dir"
MARKER = ".qwen-kvprep-cache.json"
MARKER_VERSION = 1
FOLDERS = ("builds", "locks", "tmp", "logs", "users")

_ID = re.compile(r"[0-9a-f]{32}")
_KEY = r"[0-9a-f]{64}"
# What each folder of a cache holds, by name, as qwen-kvprep writes it; a name may also be
# the temporary file of an atomic write of one (`.NAME.XXXXXXXX.tmp`).
_NAMES = {
    "locks": re.compile(rf"{_KEY}\.(lock|owner)"),
    "tmp": re.compile(rf"({_KEY}\.|\.write-test\.).+"),
    "logs": re.compile(rf"{_KEY}-.+\.log"),
}
_RECORD = re.compile(r"[0-9a-f]{16}\.json")
_ROOT_EXTRA = re.compile(rf"\.prune-test\.[0-9]+|{re.escape(MARKER)}\..+\.tmp")


class NotACache(CacheError):
    """The folder named as the build cache is not one (or not one this tool can trust)."""


class CacheNotAFolder(NotACache):
    """What was named as the build cache is a file, a FIFO, a device: a mistake in the
    naming, a usage error (2) whether --cache-dir or $QWEN_KVPREP_CACHE named it, as click
    makes it of the option."""

    exit_code = EXIT_USAGE


def _next_step(root: Path) -> str:
    return (
        f"check {CACHE_OPTION} and ${ENV_CACHE}: name the build cache qwen-kvprep made, or a "
        f"folder that does not exist yet (it is created); {root} is left as it is"
    )


def refuse(root: Path, why: str, path: Optional[Path] = None) -> NotACache:
    message = f"{root} is not a qwen-kvprep build cache: {why}"
    return NotACache.failing("build.cache", message, _next_step(root), [path or root])


def _kind(mode: int) -> str:
    return "a file" if stat.S_ISREG(mode) else kind_of(mode)


@dataclass(frozen=True)
class CacheIdentity:
    exists: bool  # the root is a folder
    cache_id: Optional[str]  # its marker's id; None: no marker (none yet, or an older cache)


def _temp_of(name: str, pattern: re.Pattern[str]) -> bool:
    # fsutil's atomic writes: `.NAME.XXXXXXXX.tmp` beside NAME
    if not (name.startswith(".") and name.endswith(".tmp")):
        return False
    inner = name[1:-4].rsplit(".", 1)[0]
    return pattern.fullmatch(inner) is not None


def _entries(folder: Path) -> Iterator[tuple[str, os.stat_result]]:
    for name in sorted(os.listdir(folder)):
        with contextlib.suppress(FileNotFoundError):
            yield name, os.lstat(folder / name)


def _check_folders(root: Path) -> None:
    """Each of the cache's own folders is absent or a real folder: never a link."""
    for name in FOLDERS:
        path = root / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise refuse(root, f"{path} cannot be read ({exc.strerror})", path) from exc
        if stat.S_ISLNK(st.st_mode):
            raise refuse(
                root,
                f"{path} is a symbolic link (to {os.readlink(path)}); qwen-kvprep follows no "
                "link it did not make, so it neither writes nor removes anything through it",
                path,
            )
        if not stat.S_ISDIR(st.st_mode):
                raise refuse(root, f"{path} is {_kind(st.st_mode)}, not a folder", path)


def _read_id(root: Path) -> Optional[str]:
    path = root / MARKER
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise refuse(root, f"its marker {path} is {_kind(st.st_mode)}", path)
    try:
        data = read_record(path)
    except (OSError, ValueError) as exc:
        raise refuse(root, f"its marker {path} cannot be read ({exc})", path) from exc
    if (
        not isinstance(data, dict)
        or data.get("qwen_kvprep_cache") != MARKER_VERSION
        or not isinstance(data.get("id"), str)
        or not _ID.fullmatch(str(data["id"]))
    ):
        raise refuse(root, f"its marker {path} is not one qwen-kvprep wrote", path)
    return str(data["id"])


def _foreign(root: Path) -> Optional[Path]:
    """The first entry of an unmarked folder that qwen-kvprep does not write, or None when
    it holds nothing else (empty, or a cache of a version before the marker)."""
    for name, _ in _entries(root):
        if name in FOLDERS or _ROOT_EXTRA.fullmatch(name):
            continue
        return root / name
    for name, st in _entries(root / "builds") if (root / "builds").is_dir() else ():
        folder = root / "builds" / name
        if not (stat.S_ISDIR(st.st_mode) and re.fullmatch(_KEY, name)):
            return folder
        try:
            manifest = read_record(folder / "manifest.json")
        except (OSError, ValueError):
            return folder
        if not isinstance(manifest, dict) or manifest.get("key") != name:
            return folder
    for sub, pattern in _NAMES.items():
        folder = root / sub
        for name, st in _entries(folder) if folder.is_dir() else ():
            if sub != "tmp" and not stat.S_ISREG(st.st_mode):
                return folder / name
            if not (pattern.fullmatch(name) or _temp_of(name, pattern)):
                return folder / name
    for name, st in _entries(root / "users") if (root / "users").is_dir() else ():
        folder = root / "users" / name
        if not (stat.S_ISDIR(st.st_mode) and re.fullmatch(_KEY, name)):
            return folder
        for record, rst in _entries(folder):
            if not stat.S_ISREG(rst.st_mode) or not (
                _RECORD.fullmatch(record) or _temp_of(record, _RECORD)
            ):
                return folder / record
    return None


def identify(root: Path) -> CacheIdentity:
    """What the folder is: absent, or a build cache (marked, or one an older version made);
    raise NotACache for anything else. Reads only."""
    try:
        st = os.stat(root)  # the root may be a link: the user named it
    except FileNotFoundError:
        return CacheIdentity(False, None)
    except OSError as exc:
        raise refuse(root, f"it cannot be read ({exc.strerror})") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise CacheNotAFolder.failing(
            "build.cache",
            f"the build cache {root} is not a folder (it is {_kind(st.st_mode)})",
            _next_step(root),
            [root],
        )
    _check_folders(root)
    cache_id = _read_id(root)
    if cache_id is None:
        try:
            foreign = _foreign(root)
        except OSError as exc:
            raise refuse(root, f"it cannot be read ({exc.strerror})") from exc
        if foreign is not None:
            raise refuse(
                root,
                f"it has no {MARKER} and holds {foreign}, which qwen-kvprep does not write",
                foreign,
            )
    return CacheIdentity(True, cache_id)


def claim(root: Path) -> str:
    """The cache's id: the folder is created and marked when it is not yet (NotACache for a
    folder that is not a cache; OSError when it cannot be written)."""
    found = identify(root)
    if found.cache_id is not None:
        return found.cache_id
    root.mkdir(parents=True, exist_ok=True)
    cache_id = uuid.uuid4().hex
    text = f'{{"qwen_kvprep_cache": {MARKER_VERSION}, "id": "{cache_id}"}}\n'
    temp = root / f"{MARKER}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        try:
            # a link, not a rename: of two processes marking one folder, the first wins
            os.link(temp, root / MARKER)
        except FileExistsError:
            return identify(root).cache_id or cache_id
        except OSError:
            # a file system without hard links: a rename (two first writers: the last wins)
            os.rename(temp, root / MARKER)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp)
    fsync_dir(root)
    return cache_id
