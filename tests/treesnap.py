"""Snapshot a directory tree (bytes, symlink targets, modes) to prove nothing changed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

Entry = Union[tuple[str, str], tuple[str, bytes, int]]


def snapshot(root: Path) -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        linked_dirs = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in sorted(filenames) + linked_dirs:
            full = Path(dirpath) / name
            rel = str(full.relative_to(root))
            if full.is_symlink():
                out[rel] = ("link", os.readlink(full))
            else:
                st = full.stat()
                out[rel] = ("file", full.read_bytes(), st.st_mode)
    return out
