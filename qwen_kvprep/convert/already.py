"""Whether OUT already holds the conversion asked for, so that running the same convert
again is a no-op (as fix is), not a refusal.

It is, when OUT is a folder convert completed (its provenance.json is there and sound),
made from this very DIR (the same folder by device and inode, however it is spelt), with
the same options, DIR's recorded files unchanged and OUT's files exactly the ones the
record lists, each as convert wrote it (judged as doctor's convert.provenance judges:
sha256 for small files, size and modification time for weights, hashed when those differ).
A record made with verification also serves a run that skips it; not the other way round.
Reads only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep.convert.output import own_names
from qwen_kvprep.probe.converted import ConvertedFacts, FileState, probe_converted
from qwen_kvprep.provenance import PROVENANCE, Provenance


@dataclass(frozen=True)
class Asked:
    """The options of this run that change what OUT holds, as provenance.json records
    them."""

    max_shard_size: Optional[int] = None
    context_factor: Optional[float] = None
    rope_scaling: Optional[str] = None
    verify: bool = True


def _same_source(rec: Provenance, directory: Path) -> bool:
    """Whether `directory` is the folder OUT was made from: its device and inode as
    recorded (however it is spelt or wherever it moved), else (an older record) the
    folder at the recorded path."""
    if rec.source_identity is None:
        return same_place(Path(rec.source_path), directory)
    try:
        st = os.stat(directory)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == rec.source_identity


def same_place(a: Path, b: Path) -> bool:
    """Whether `a` and `b` are one folder (device and inode: links and spellings agree)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _given(option: str, value: object) -> str:
    return f"without {option}" if value is None else f"with {option} {value}"


def _changed(states: tuple[FileState, ...]) -> list[str]:
    return [f"{s.name} ({s.state})" for s in states if s.state != "same"]


def _recorded(rec: Provenance) -> Asked:
    options = rec.extra.get("options")
    context = rec.extra.get("context")
    opts = options if isinstance(options, dict) else {}
    ctx = context if isinstance(context, dict) else {}
    shard, factor, rope = opts.get("max_shard_size"), ctx.get("factor"), ctx.get("rope_scaling")
    return Asked(
        max_shard_size=shard if isinstance(shard, int) and not isinstance(shard, bool) else None,
        context_factor=float(factor) if isinstance(factor, (int, float))
        and not isinstance(factor, bool) else None,
        rope_scaling=rope if isinstance(rope, str) else None,
        verify=opts.get("verify") is True,
    )


def mismatch(directory: Path, cv: ConvertedFacts, asked: Asked) -> Optional[str]:
    """Why the conversion in `cv` is not the one asked for (None: it is, and convert has
    nothing to do). Pure but for the stat of the two source folders."""
    rec = cv.provenance
    if rec is None:
        return f"its {PROVENANCE} cannot be trusted ({cv.error})"
    if not _same_source(rec, directory):
        return f"it was converted from {rec.source_path}" + (
            " (another folder than the one there now)" if same_place(
                Path(rec.source_path), directory) else "") + f", not from {directory}"
    done = _recorded(rec)
    for what, was, now in (
        ("--max-shard-size", done.max_shard_size, asked.max_shard_size),
        ("--context-factor", done.context_factor, asked.context_factor),
        ("--rope-scaling", done.rope_scaling, asked.rope_scaling),
    ):
        if was != now:
            return f"it was converted {_given(what, was)}, this run asks for it {_given(what, now)}"
    if asked.verify and not done.verify:
        return "it was converted with --no-verify, this run asks for the verification"
    if not rec.source_files:
        return f"its {PROVENANCE} records none of DIR's files"
    source = _changed(cv.sources)
    if source:
        return f"DIR's files changed since: {', '.join(source[:3])}"
    out = _changed(cv.outputs)
    if out:
        return f"its files are no longer what convert wrote: {', '.join(out[:3])}"
    foreign = [n for n in cv.unrecorded if n not in own_names(cv.path)]  # a kill's: tidy()
    if foreign:
        return f"it holds files convert did not write: {', '.join(foreign[:3])}"
    return None


def completed(directory: Path, out: Path, asked: Asked) -> tuple[Optional[Provenance], str]:
    """(OUT's record when OUT already holds this conversion, else None; why not, "" when
    OUT holds no conversion at all)."""
    if os.path.islink(out) or not os.path.isdir(out):
        return None, ""
    cv = probe_converted(out, source=directory)
    if cv is None or cv.foreign is not None:
        return None, ""
    why = mismatch(directory, cv, asked)
    return (cv.provenance, "") if why is None else (None, why)
