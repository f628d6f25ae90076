"""Snapshot a directory tree to prove that nothing in it changed.

Every entry, the root included, is recorded by kind without following a link: a file by its
bytes (or their SHA-256) and mode, a folder by its mode, a link by its target, anything else
(a FIFO, a socket, a device) by its mode only: it is never opened, so a FIFO that stands for
a file nobody may read cannot hang the snapshot. With `mtimes`, every entry also carries its
modification time, so that rewriting a file with the same bytes shows too.

The stat, readlink and open used here are the ones of the time this module was imported, so
a test that patches them to see what the code under test touches does not see the snapshot.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import stat
from pathlib import Path

Entry = tuple[object, ...]
Snapshot = dict[str, Entry]

_lstat, _readlink, _open = os.lstat, os.readlink, builtins.open


def _entry(path: str, digest: bool, mtimes: bool) -> Entry:
    st = _lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    entry: Entry
    if stat.S_ISLNK(st.st_mode):
        entry = ("link", _readlink(path))
    elif stat.S_ISDIR(st.st_mode):
        entry = ("dir", mode)
    elif stat.S_ISREG(st.st_mode):
        with _open(path, "rb") as fh:
            data = fh.read()
        entry = ("file", hashlib.sha256(data).hexdigest() if digest else data, mode)
    else:
        entry = ("other", stat.S_IFMT(st.st_mode), mode)
    return (*entry, st.st_mtime_ns) if mtimes else entry


def snapshot(root: Path, *, digest: bool = False, mtimes: bool = False) -> Snapshot:
    """Every entry under `root` by its path relative to it, `root` itself as ".";
    empty when `root` does not exist."""
    if not os.path.lexists(root):
        return {}
    out: Snapshot = {".": _entry(str(root), digest, mtimes)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, root)] = _entry(full, digest, mtimes)
    return out
