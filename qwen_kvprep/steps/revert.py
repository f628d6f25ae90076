"""`revert`: undo every change `fix` recorded in the checkpoint's journal."""

from __future__ import annotations

from pathlib import Path

from qwen_kvprep.journal import Journal


def revert_checkpoint(directory: Path) -> list[str]:
    journal = Journal(directory)
    if not journal.exists:
        return []
    return journal.revert()
