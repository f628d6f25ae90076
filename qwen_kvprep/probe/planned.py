"""What fix planned, read from its journal, against what the disk holds now.

The journal records the sha256 of each version fix writes to a path before it writes it
(journal/writer.py: intent first), so a `fix` cut short (Ctrl-C, a kill, a full disk)
leaves entries whose last version never reached the disk: the file is missing, or still
holds what was there before. doctor judges those (checks/caches.py, `modules.complete`);
this module only reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep.journal.reader import (
    Entry,
    JournalData,
    Present,
    folder_identity,
    present,
    same_folder,
)


@dataclass(frozen=True)
class PlannedFile:
    """A file fix wrote, or was about to write, and what its path holds now."""

    path: str
    folder: Optional[str]  # the modules-cache folder it was planted in; None: the checkpoint
    planned: str  # sha256 of the last version fix wrote there (or was about to)
    found: Optional[str]  # sha256 of the regular file there now; None: none is
    what: str = ""  # what is there when it is not a regular file ("nothing", "a symlink"...)
    # what is there is what was there before fix, or a version fix wrote earlier
    earlier: bool = False

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def _what(current: Present) -> str:
    if current.kind == "absent":
        return "nothing"
    if current.kind == "symlink":
        return f"a symlink to {current.target}"
    return current.what or "not a regular file"


def _judge(path: Path, folder: Optional[str], entry: Entry) -> Optional[PlannedFile]:
    written = entry["written"] or []
    if not written:  # nothing fix wrote there (a version 1 journal, an adopted copy)
        return None
    try:
        current = present(path)
    except (OSError, ValueError) as exc:  # unreadable: not what fix wrote either
        return PlannedFile(str(path), folder, written[-1], None, f"unreadable ({exc})")
    if current.kind == "file":
        digest = current.digest
        earlier = digest in written[:-1] or (
            entry["kind"] == "file" and digest == entry.get("sha256")
        )
        return PlannedFile(str(path), folder, written[-1], digest, earlier=earlier)
    earlier = (entry["kind"] == "absent" and current.kind == "absent") or (
        entry["kind"] == "symlink"
        and current.kind == "symlink"
        and current.target == entry.get("target")
    )
    return PlannedFile(str(path), folder, written[-1], None, _what(current), earlier)


def planned_files(journal: JournalData, directory: Path) -> tuple[PlannedFile, ...]:
    """Every file the journal says fix wrote in `directory`, and those it planted in the
    modules cache for this folder (not for the folder a copy was made from)."""
    out: list[PlannedFile] = []
    for rel, entry in sorted(journal["files"].items()):
        found = _judge(Path(directory) / rel, None, entry)
        if found is not None:
            out.append(found)
    me = folder_identity(Path(directory))
    for group in journal["planted"]:
        if not same_folder(group["owner"], me):
            continue
        for rel, entry in sorted(group["files"].items()):
            path = Path(os.path.abspath(Path(group["root"]) / rel))
            found = _judge(path, str(path.parent), entry)
            if found is not None:
                out.append(found)
    return tuple(out)
