"""journal.json read back: its schema and its limits.

`fix` records in `<checkpoint>/.qwen-kvprep/journal.json` every file it changed (in the
checkpoint, and planted in the modules cache) with what was there before: a file (its
bytes kept under `originals/`, named by their sha256, with its mode), a symlink (its
target) or nothing. That record lies in a folder anyone with write access may have changed
(or copied elsewhere): it is read with a size and depth limit and checked against its
schema; every path in it must be relative and confined (to the checkpoint for its files,
to `originals/` for the stored originals, to the modules-cache root for planted files);
each original's sha256 is verified before revert would restore it. Planted files are
recorded relative to the modules root together with the identity of the folder `fix` ran
on, so reverting a copy (`cp -a DIR COPY`) never removes what DIR's model still uses; each
modules-cache folder lists the prepared folders that use it (`.qwen-kvprep-users/`), and a
file another prepared folder still uses stays.

What revert would do with it is decided in probe/revertplan.py (`plan_revert`), above
this base module: that is a reading of the disk as it is now, not a data format.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional, TypedDict

from qwen_kvprep.common import (
    FAST_FILE,
    JOURNAL_FILE,
    KERNEL_FILES,
    LOADER_FILE,
    STATE_DIRNAME,
)
from qwen_kvprep.common import sha256_bytes as sha256
from qwen_kvprep.errors import StateError
from qwen_kvprep.untrusted import (
    RECORD_LIMIT,
    describe_json_error,
    kind_of,
    lstat_at,
    read_record,
    read_regular,
    relpath_problem,
)

if TYPE_CHECKING:
    from typing import TypeGuard

    from qwen_kvprep.jsontypes import JSON, JSONObject

JOURNAL_VERSION = 2
ORIGINALS = "originals"
# The files fix changes are a few KiB to a few hundred KiB.
ORIGINAL_LIMIT = 64 << 20
# How many versions fix wrote to one path are remembered as "ours".
WRITTEN_KEEP = 8
_HEX64 = re.compile(r"[0-9a-f]{64}")
STORE_NAME = re.compile(r"[0-9a-f]{16}|[0-9a-f]{64}")  # version 1 used 16 hex digits
_KINDS = ("file", "symlink", "absent")

# What was at a recorded path before fix wrote it.
Kind = Literal["file", "symlink", "absent"]


class _EntryKeys(TypedDict):
    kind: Kind
    # sha256 of each version fix wrote there, oldest first (None: a version 1 journal,
    # which did not record them)
    written: Optional[list[str]]


class Entry(_EntryKeys, total=False):
    """One recorded path, as check_journal returns it."""

    store: str  # a file: where its original is kept, "originals/<sha256>"
    sha256: Optional[str]  # a file: its original's sha256 (None: version 1)
    mode: Optional[int]  # a file: its original's permission bits (None: version 1)
    target: str  # a symlink: its target
    adopted: bool  # already there, as fix would write it, when fix first planted it


class FolderIdentity(TypedDict):
    """What identifies a prepared folder: its absolute path and its inode."""

    path: str
    dev: int
    ino: int


class PlantedGroup(TypedDict):
    """The files fix planted below one modules-cache root for one prepared folder."""

    root: str  # absolute
    owner: FolderIdentity
    files: dict[str, Entry]  # relative to root


class JournalData(TypedDict):
    """The journal in normal form, as check_journal returns it."""

    version: int
    files: dict[str, Entry]  # relative to the checkpoint
    planted: list[PlantedGroup]


def quote(path: object) -> str:
    return shlex.quote(str(path))


def folder_identity(directory: Path) -> FolderIdentity:
    """What identifies a prepared folder: its absolute path and its inode."""
    path = os.path.abspath(directory)
    try:
        st = os.stat(path)
        dev, ino = st.st_dev, st.st_ino
    except OSError:
        dev, ino = -1, -1
    return {"path": path, "dev": dev, "ino": ino}


def same_folder(owner: FolderIdentity, identity: FolderIdentity) -> bool:
    if owner.get("path") == identity["path"]:
        return True
    return (owner.get("dev"), owner.get("ino")) == (identity["dev"], identity["ino"]) and (
        identity["ino"] != -1
    )


# ------------------------------------------------------------------ what is at a path


@dataclass(frozen=True)
class Present:
    """What a path holds: kind "absent", "symlink" (target), "file" (data) or "other"."""

    kind: str
    data: Optional[bytes] = None
    target: Optional[str] = None
    what: str = ""  # for "other": "a FIFO (named pipe)", ...

    @property
    def digest(self) -> Optional[str]:
        return sha256(self.data) if self.data is not None else None


def present_at(fd: int, name: str) -> Present:
    """What `name` in the folder `fd` holds; the entry itself, never followed."""
    st = lstat_at(fd, name)
    if st is None:
        return Present("absent")
    if stat.S_ISLNK(st.st_mode):
        return Present("symlink", target=os.readlink(name, dir_fd=fd))
    if not stat.S_ISREG(st.st_mode):
        return Present("other", what=kind_of(st.st_mode))
    return Present("file", data=read_regular(name, ORIGINAL_LIMIT, follow=False, dir_fd=fd))


def present(path: Path) -> Present:
    try:
        fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        return Present("absent")
    try:
        return present_at(fd, path.name)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the schema


class Invalid(Exception):
    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where} {why}")
        self.where = where
        self.why = why


def _known_kind(kind: JSON) -> TypeGuard[Kind]:
    return kind in _KINDS


def _digests(value: JSON) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(
        isinstance(w, str) and _HEX64.fullmatch(w) for w in value
    )


def _integer(value: JSON) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_entry(entry: JSON, where: str, version: int) -> Entry:
    if not isinstance(entry, dict):
        raise Invalid(where, "is not an object")
    kind = entry.get("kind")
    if not _known_kind(kind):
        raise Invalid(where, f"has an unknown kind {kind!r}")
    out: Entry = {"kind": kind, "written": None}
    if kind == "file":
        store = entry.get("store")
        why = relpath_problem(store)
        if why is None:
            parts = str(store).split("/")
            if len(parts) != 2 or parts[0] != ORIGINALS or not STORE_NAME.fullmatch(parts[1]):
                why = f"is not a file directly in {ORIGINALS}/"
        if why is not None:
            raise Invalid(where, f"keeps its original at {store!r}, which {why}")
        out["store"] = str(store)
        digest = entry.get("sha256")
        if (version >= 2 or digest is not None) and (
            not isinstance(digest, str) or not _HEX64.fullmatch(digest)
        ):
            raise Invalid(where, "has no valid sha256 of its original")
        out["sha256"] = digest
        mode = entry.get("mode")
        if mode is not None and (
            not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777
        ):
            raise Invalid(where, f"has an invalid mode {mode!r}")
        out["mode"] = mode
    elif kind == "symlink":
        target = entry.get("target")
        if not isinstance(target, str) or not target or "\x00" in target or len(target) > 4096:
            raise Invalid(where, "has no valid symlink target")
        out["target"] = target
    written = entry.get("written")
    if written is None:
        # version 1 did not record what fix wrote: whatever is there counts as fix's
        out["written"] = None
    elif not _digests(written):
        raise Invalid(where, "has an invalid list of written sha256")
    else:
        out["written"] = list(written)[-WRITTEN_KEEP:]
    if entry.get("adopted") is True:
        out["adopted"] = True
    return out


def _check_table(table: JSON, where: str, version: int) -> dict[str, Entry]:
    if not isinstance(table, dict):
        raise Invalid(where, "is not an object")
    out = {}
    for rel, entry in table.items():
        why = relpath_problem(rel)
        if why is not None:
            raise Invalid(f"{where} entry {rel!r}", why)
        out[rel] = _check_entry(entry, f"{where} entry {rel!r}", version)
    return out


def _check_owner(owner: JSON, where: str) -> FolderIdentity:
    if not isinstance(owner, dict):
        raise Invalid(where, "has no owner")
    path, dev, ino = owner.get("path"), owner.get("dev"), owner.get("ino")
    if not isinstance(path, str) or not os.path.isabs(path) or "\x00" in path:
        raise Invalid(where, "has an owner without an absolute path")
    if not (_integer(dev) and _integer(ino)):
        raise Invalid(where, "has an owner without a device and inode")
    return {"path": os.path.normpath(path), "dev": dev, "ino": ino}


# What fix plants in the modules cache, which other models share: a journal naming any
# other file there (someone else's modeling code) would make revert delete or overwrite it.
PLANTABLE = frozenset((*KERNEL_FILES, LOADER_FILE, FAST_FILE))


def _check_planted(table: dict[str, Entry], where: str) -> dict[str, Entry]:
    for rel in table:
        if os.path.basename(rel) not in PLANTABLE:
            raise Invalid(
                f"{where} entry {rel!r}",
                f"is not a file fix plants ({', '.join(sorted(PLANTABLE))})",
            )
    return table


def _check_groups(groups: JSON, version: int) -> list[PlantedGroup]:
    if not isinstance(groups, list):
        raise Invalid("planted", "is not a list")
    out: list[PlantedGroup] = []
    for i, group in enumerate(groups):
        where = f"planted[{i}]"
        if not isinstance(group, dict):
            raise Invalid(where, "is not an object")
        root = group.get("root")
        if not isinstance(root, str) or not os.path.isabs(root) or "\x00" in root:
            raise Invalid(where, "has no absolute modules-cache root")
        out.append(
            {
                "root": os.path.normpath(root),
                "owner": _check_owner(group.get("owner"), where),
                "files": _check_planted(
                    _check_table(group.get("files"), f"{where} files", version), f"{where} files"
                ),
            }
        )
    return out


def _from_version_1(data: JSONObject, directory: Path, modules_root: Path) -> JournalData:
    """Version 1 recorded planted files by absolute path: they are taken relative to this
    environment's modules root (anything else is refused), owned by `directory`."""
    files = _check_table(data.get("files", {}), "files", 1)
    planted = data.get("planted", {})
    if not isinstance(planted, dict):
        raise Invalid("planted", "is not an object")
    root = os.path.abspath(modules_root)
    group: dict[str, Entry] = {}
    for key, entry in planted.items():
        where = f"planted entry {key!r}"
        if not isinstance(key, str) or not os.path.isabs(key):
            raise Invalid(where, "is not an absolute path")
        rel = os.path.relpath(os.path.normpath(key), root)
        why = relpath_problem(rel)
        if why is not None:
            raise Invalid(where, f"is outside the modules cache {root}")
        group[rel] = _check_entry(entry, where, 1)
    _check_planted(group, "planted")
    groups: list[PlantedGroup] = []
    if group:
        groups.append({"root": root, "owner": folder_identity(directory), "files": group})
    return {"version": JOURNAL_VERSION, "files": files, "planted": groups}


def check_journal(data: JSON, directory: Path, modules_root: Path) -> JournalData:
    """The journal's content in normal form; Invalid names the entry that is wrong.
    `modules_root`: this environment's modules-cache root (a version 1 journal's planted
    files are taken relative to it)."""
    if not isinstance(data, dict):
        raise Invalid("the journal", "is not a JSON object")
    version = data.get("version")
    if version == 1:
        return _from_version_1(data, directory, modules_root)
    if version != JOURNAL_VERSION:
        raise Invalid("the journal", f"has version {version!r}, not {JOURNAL_VERSION}")
    return {
        "version": JOURNAL_VERSION,
        "files": _check_table(data.get("files"), "files", JOURNAL_VERSION),
        "planted": _check_groups(data.get("planted"), JOURNAL_VERSION),
    }


def empty_journal() -> JournalData:
    return {"version": JOURNAL_VERSION, "files": {}, "planted": []}


def read_journal(directory: Path, modules_root: Path) -> JournalData:
    """DIR's journal in normal form (empty when there is none). StateError, with the way to
    recover by hand, when it cannot be read or is damaged."""
    state_dir = Path(directory) / STATE_DIRNAME
    path = state_dir / JOURNAL_FILE
    try:
        raw = read_record(path, RECORD_LIMIT)
        return check_journal(raw, Path(directory), modules_root)
    except FileNotFoundError:
        return empty_journal()
    except Invalid as exc:
        raise StateError(
            f"the journal {path} is damaged or was edited: {exc}",
            fix=manual_recovery(state_dir),
        ) from None
    except (OSError, ValueError) as exc:
        raise StateError(
            f"the journal {path} {describe_json_error(exc)}",
            fix=manual_recovery(state_dir),
        ) from None


def journal_problem(directory: Path, modules_root: Path) -> Optional[str]:
    """Why DIR's journal cannot be used (None: it is fine or there is none). For doctor."""
    try:
        read_journal(directory, modules_root)
    except StateError as exc:
        return exc.message
    return None


def link_advice(links: Sequence[Path], directory: Path) -> str:
    """What to do when revert's only problem is modules-cache folders replaced by links:
    that cache is transformers' copy of the model code (made again at the next load), so
    removing the links is all it takes."""
    removes = " ".join(quote(link) for link in links)
    return (
        f"nothing was changed. Remove the link{'s' if len(links) > 1 else ''} "
        f"(`rm {removes}`: the modules cache is transformers' copy of the model code, made "
        f"again at the next load; what the link points to is not touched), then run "
        f"`qwen-kvprep revert {quote(directory)}` again"
    )


def manual_recovery(state_dir: Path) -> str:
    return (
        f"nothing was changed. Restore by hand what you need: the originals fix replaced are "
        f"in {quote(state_dir / ORIGINALS)} (named by their sha256; `sha256sum` them), "
        f"{quote(state_dir / JOURNAL_FILE)} says which file each one was; then remove "
        f"{quote(state_dir)}"
    )
