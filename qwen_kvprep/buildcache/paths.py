"""Where the build cache lives and how it is laid out.

    <cache>/.qwen-kvprep-cache.json         the marker: this is a build cache, and its id
                                            (buildcache/marker.py)
    <cache>/builds/<key>/   published builds: manifest.json, the extension, build.log
    <cache>/locks/<key>.lock, <key>.owner   one lock per key; who holds it
    <cache>/tmp/<key>.<pid>.<rand>/         builds in progress (renamed into builds/)
    <cache>/logs/<key>-<time>.log           logs of failed builds
    <cache>/users/<key>/<id>.json           one per prepared folder fix pointed at the build
                                            ({"path": DIR}; buildcache/inventory.py)

Everything a build writes goes under tmp/ first, on the same file system as builds/, so
publishing is one rename: a reader sees a complete build or none.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep.buildcache.marker import CACHE_OPTION, claim
from qwen_kvprep.common import ENV_CACHE, build_cache_root
from qwen_kvprep.errors import CacheError

__all__ = ["CACHE_OPTION", "CacheLayout", "not_writable", "resolve_cache_dir"]


def resolve_cache_dir(option: Optional[Path] = None) -> Path:
    """--cache-dir > $QWEN_KVPREP_CACHE > $XDG_CACHE_HOME/qwen-kvprep > ~/.cache/qwen-kvprep."""
    return Path(build_cache_root(option)[0])


class _Folder:
    """A folder right below the cache's root, named as the attribute that holds it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, layout: CacheLayout, owner: Optional[type] = None) -> Path:
        return layout.root / self.name


@dataclass(frozen=True)
class CacheLayout:
    root: Path

    builds = _Folder()
    locks = _Folder()
    tmp = _Folder()
    logs = _Folder()
    users = _Folder()

    def users_dir(self, key: str) -> Path:
        return self.users / key

    def build_dir(self, key: str) -> Path:
        return self.builds / key

    def lock_path(self, key: str) -> Path:
        return self.locks / f"{key}.lock"

    def owner_path(self, key: str) -> Path:
        return self.locks / f"{key}.owner"

    def ensure_writable(self) -> str:
        """Create the folders and prove a file can be written, or raise a CacheError that
        names the folder and how to use another one; NotACache (buildcache/marker.py) for a
        folder that is not a build cache. Returns the cache's id."""
        try:
            cache_id = claim(self.root)
            for folder in (self.builds, self.locks, self.tmp, self.logs):
                folder.mkdir(parents=True, exist_ok=True)
            # os.access lies for root and on some network file systems: really write.
            fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=self.tmp)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise not_writable(self.root, exc) from exc
        return cache_id


def not_writable(root: Path, exc: OSError) -> CacheError:
    reason = exc.strerror or str(exc)
    where = exc.filename or root
    message = f"the build cache folder {root} is not writable ({reason}: {where})"
    fix = (
        f"use another folder: `{CACHE_OPTION} DIR` or `export {ENV_CACHE}=DIR` "
        f"(or make {root} writable)"
    )
    return CacheError.failing("build.cache", message, fix, [root])
