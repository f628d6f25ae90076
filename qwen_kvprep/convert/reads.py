"""The files convert read and wrote, as they were when it read them, and the checks that
they are still those files when OUT is published.

provenance.json records each file's sha256 with its size and modification time, and
`unchanged` and doctor later judge a large file by those two alone: they must be the
bytes' own. So each file is hashed through one descriptor, and its identity (device,
inode, size, modification time) is taken from that descriptor, before and after the
read: a file replaced by a rename meanwhile (as a re-download does) keeps the descriptor
on the old bytes, and a path's `stat` would name the new file. Before publishing, each
path is looked at again: a file of DIR replaced, changed, removed or added since is said
as such (not blamed on the model), and a staged file changed since it was read back is
not published.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep.errors import CheckpointError, RefusedError
from qwen_kvprep.provenance import FileRecord
from qwen_kvprep.untrusted import open_regular

_CHUNK = 1 << 20
Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns
AGAIN = "run convert again once nothing writes DIR (a download or a sync still running?)"


def identity(st: os.stat_result) -> Identity:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class Read:
    """A file as read: the sha256 of the bytes read, and the identity of the file they
    were read from."""

    sha256: str
    ident: Identity

    @property
    def record(self) -> FileRecord:
        return FileRecord(self.sha256, self.ident[2], self.ident[3])


def read_of(name: str, sha256: str, before: os.stat_result, after: os.stat_result) -> Read:
    """The Read of a file whose descriptor gave `before` as the read began and `after` as
    it ended (CheckpointError when the file changed in between)."""
    if identity(before) != identity(after):
        raise CheckpointError(f"{name} changed while it was read", fix=AGAIN)
    return Read(sha256, identity(after))


def hash_file(path: Path) -> Read:
    """The file at `path` (a link followed) hashed through one descriptor."""
    digest = hashlib.sha256()
    fd = open_regular(path)
    try:
        before = os.fstat(fd)
        for chunk in iter(lambda: os.read(fd, _CHUNK), b""):
            digest.update(chunk)
        return read_of(path.name, digest.hexdigest(), before, os.fstat(fd))
    finally:
        os.close(fd)


def snapshot(directory: Path, names: Iterable[str]) -> dict[str, Read]:
    """The files of `names` that `directory` holds, hashed now (absent or unreadable
    ones are left out: their own checks say what is wrong with them)."""
    out: dict[str, Read] = {}
    for name in names:
        try:
            out[name] = hash_file(directory / name)
        except OSError:
            continue
    return out


def _state(path: Path, ident: Optional[Identity]) -> Optional[str]:
    """How the file at `path` differs from `ident` (None: absent then), None when not."""
    try:
        now: Optional[Identity] = identity(os.stat(path))
    except FileNotFoundError:
        now = None
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if ident is None:
        return None if now is None else "added"
    if now is None:
        return "removed"
    if now[:2] != ident[:2]:
        return "replaced"
    return None if now == ident else "changed"


def moved(directory: Path, reads: Mapping[str, Read], considered: Iterable[str] = ()) -> list[str]:
    """The files of DIR that are no longer the ones read ("NAME (replaced)"): each of
    `reads`, and each of `considered` that was absent then."""
    names = sorted(set(reads) | set(considered))
    said = []
    for name in names:
        read = reads.get(name)
        state = _state(directory / name, read.ident if read is not None else None)
        if state is not None:
            said.append(f"{name} ({state})")
    return said


def _rehashed(directory: Path, reads: Mapping[str, Read], names: Iterable[str]) -> list[str]:
    """Those of `names` (small files) whose bytes are no longer the ones read, whatever
    their modification time says."""
    said = []
    for name in names:
        read = reads.get(name)
        if read is None:
            continue
        try:
            same = hash_file(directory / name).sha256 == read.sha256
        except (OSError, CheckpointError):
            same = False
        if not same:
            said.append(f"{name} (changed)")
    return said


def check_dir(directory: Path, reads: Mapping[str, Read], considered: Iterable[str]) -> None:
    """RefusedError when a file of DIR convert read (or, of `considered`, found absent) is
    not as it was; the `considered` files (configs, the tokenizer: small) are hashed again."""
    considered = list(considered)
    said = moved(directory, reads, considered) or _rehashed(directory, reads, considered)
    if said:
        raise RefusedError(
            f"DIR changed while convert read it: {', '.join(said[:3])}"
            + (f" (and {len(said) - 3} more)" if len(said) > 3 else "")
            + f" in {directory}; OUT would not be what provenance.json says it was made "
            "from, and the proof would compare OUT with other bytes; OUT was not written",
            fix=AGAIN,
        )


def check_staged(staging: Path, reads: Mapping[str, Read]) -> None:
    """RefusedError when a staged file is no longer the one read back and recorded."""
    said = moved(staging, reads)
    if said:
        raise RefusedError(
            f"a staged file changed after convert read it back: {', '.join(said[:3])} in "
            f"{staging}; OUT was not written",
            fix="run convert again, and make sure nothing else writes into the staging "
            "folder (another program watching the folder?)",
        )
