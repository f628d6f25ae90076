"""What a load left in a modules-cache folder because of fix, for revert to take out.

transformers copies modeling_qwen.py (with the lines fix added) and the modules it
imports relatively (qwen_kvprep_compat.py) into the folder it runs the code from, and
Python may cache their bytecode there. Once no prepared folder uses that folder, such a
copy would run without the fast-path module beside it (transformers 4.x keeps the folder
by name and may take the copy as current), so revert removes it: a modeling_qwen.py only
while it holds qwen-kvprep's markers, our modules only while byte for byte what fix writes,
never through a symlink; and on transformers 5.x the hash folder itself once empty (its
name is the hash of the code with our lines, so no load of the user's code comes back
to it)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from qwen_kvprep import compat, fastkv
from qwen_kvprep.common import COMPAT_FILE, FAST_FILE, MODELING_FILE
from qwen_kvprep.journal.reader import present_at
from qwen_kvprep.untrusted import lstat_at, open_dir_under

PYCACHE = "__pycache__"
# transformers 5.x: transformers_modules/<name>/<hash of the code>
HASH_FOLDER = re.compile(r"transformers_modules/[^/]+/[0-9a-f]{16}")


def ours(name: str, data: bytes) -> bool:
    """Whether `data` at `name` is a copy of what fix wrote (or changed) in the folder."""
    if name == MODELING_FILE:
        text = data.decode("utf-8", errors="replace")
        return compat.START_MARK in text or compat.END_MARK in text
    if name == COMPAT_FILE:
        return data == compat.compat_bytes()
    if name == FAST_FILE:
        return any(data == fastkv.module_bytes(per_token) for per_token in (False, True))
    return False


def copies(here: Path, folder: list[str], planted: set[str]) -> list[str]:
    """The names in the modules-cache folder `here/folder` (reached without following a
    symlink) that are copies of fix's files a load made, left out of `planted` (those
    the journal itself handles)."""
    try:
        fd = open_dir_under(here, folder)
    except OSError:
        return []
    try:
        found = []
        for name in (MODELING_FILE, COMPAT_FILE, FAST_FILE):
            if name in planted:
                continue
            try:
                current = present_at(fd, name)
            except (OSError, ValueError):
                continue
            if current.kind == "file" and current.data is not None and ours(name, current.data):
                found.append(name)
        return found
    finally:
        os.close(fd)


def bytecode(here: Path, folder: list[str], names: set[str]) -> list[str]:
    """The regular files in `here/folder/__pycache__` that are the bytecode of `names`
    (`<stem>.<tag>.pyc`)."""
    stems = {n[:-3] for n in names if n.endswith(".py")}
    try:
        fd = open_dir_under(here, [*folder, PYCACHE])
    except OSError:
        return []
    try:
        found = []
        for entry in sorted(os.listdir(fd)):
            stem, _, rest = entry.partition(".")
            if stem not in stems or not rest.endswith(".pyc"):
                continue
            st = lstat_at(fd, entry)
            if st is not None and stat.S_ISREG(st.st_mode):
                found.append(entry)
        return found
    finally:
        os.close(fd)


def left_empty(here: Path, folder: list[str], removed: set[str], gone: set[str]) -> bool:
    """Whether `here/folder` (a real folder) holds nothing once `removed` (names in it) and
    the folders in `gone` (names in it, emptied) are gone."""
    try:
        fd = open_dir_under(here, folder)
    except OSError:
        return False
    try:
        return not (set(os.listdir(fd)) - removed - gone)
    finally:
        os.close(fd)
