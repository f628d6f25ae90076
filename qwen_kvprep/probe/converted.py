"""Probe a folder `convert` wrote: its provenance.json, and whether the files it records
(DIR's sources, OUT's own) are still the ones convert read and wrote.

A file is judged by its sha256 when it is small (configs, tokenizer, an index), and a
weight file by its size and modification time, read in full only when those disagree with
the record: a 72B source is 145 GB, and doctor answers in seconds. That quick look misses a
change that keeps the size and the time (`touch -r`, `cp -p`, bit rot): `full` hashes
every file (the engine smoke, which reads them all anyway). Never writes; a record that
cannot be trusted becomes `error`, never an exception.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep.common import sha256_file
from qwen_kvprep.errors import KvprepError
from qwen_kvprep.provenance import PROVENANCE, FileRecord, Provenance, foreign, read

HASH_LIMIT = 64 << 20  # files up to this size are always hashed
QUICK = "size and modification time"
LOST_FOUND = "lost+found"  # what mkfs (ext4, xfs) puts in a new volume


@dataclass(frozen=True)
class FileState:
    name: str
    state: str  # "same" | "changed" | "missing" | "unreadable"
    how: str = ""  # "sha256", QUICK (not read), "size", or why it is unreadable


@dataclass(frozen=True)
class ConvertedFacts:
    path: Path
    provenance: Optional[Provenance] = None
    error: Optional[str] = None  # why provenance.json cannot be trusted
    source_exists: bool = False
    sources: tuple[FileState, ...] = ()
    outputs: tuple[FileState, ...] = ()
    unrecorded: tuple[str, ...] = ()  # files in OUT that the record does not list
    # why the provenance.json here is another tool's, not convert's: it is then ignored
    foreign: Optional[str] = None


def judge(path: Path, name: str, rec: FileRecord, full: bool = False) -> FileState:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return FileState(name, "missing")
    except OSError as exc:
        return FileState(name, "unreadable", exc.strerror or str(exc))
    if st.st_size != rec.size:
        return FileState(name, "changed", "size")
    quick = st.st_size > HASH_LIMIT and rec.mtime_ns is not None and st.st_mtime_ns == rec.mtime_ns
    if quick and not full:
        return FileState(name, "same", QUICK)
    try:
        same = sha256_file(path) == rec.sha256
    except OSError as exc:
        return FileState(name, "unreadable", exc.strerror or str(exc))
    return FileState(name, "same" if same else "changed", "sha256")


def probe_converted(
    out: Path, full: bool = False, source: Optional[Path] = None,
) -> Optional[ConvertedFacts]:
    """None when `out` holds no provenance.json (not a folder convert wrote); `foreign` set
    when the one it holds does not say convert wrote it. `full`: every file recorded is
    hashed, however large. DIR's files are judged in `source` (the folder a rerun names),
    else at the recorded path."""
    if not os.path.lexists(out / PROVENANCE):
        return None
    why = foreign(out)
    if why is not None:
        return ConvertedFacts(out, foreign=why)
    try:
        rec = read(out)
    except KvprepError as exc:
        return ConvertedFacts(out, error=exc.message)
    except OSError as exc:
        return ConvertedFacts(out, error=f"{out / PROVENANCE} cannot be read: {exc}")
    src = source if source is not None else Path(rec.source_path)
    exists = src.is_dir()
    sources = tuple(
        judge(src / n, n, r, full) for n, r in sorted(rec.source_files.items())
    ) + tuple(
        FileState(n, "changed", "there now, absent when converted")  # a fresh convert reads it
        for n in rec.absent_inputs if os.path.lexists(src / n)
    ) if exists else ()
    outputs = tuple(judge(out / n, n, r, full) for n, r in sorted(rec.outputs.items()))
    try:  # a folder counts as much as a file; a fresh volume's lost+found is no one's
        present = {p.name for p in out.iterdir() if p.name != LOST_FOUND or not p.is_dir()}
    except OSError:
        present = set()
    unrecorded = tuple(sorted(present - set(rec.outputs) - {PROVENANCE}))
    return ConvertedFacts(out, rec, None, exists, sources, outputs, unrecorded)
