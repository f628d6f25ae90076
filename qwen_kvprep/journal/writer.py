"""Every change qwen-kvprep makes to a checkpoint goes through a Journal.

The journal keeps each file's original once (bytes under `originals/`, named by their
sha256; the link target of a symlink; or the fact that it did not exist) under
`<checkpoint>/.qwen-kvprep/`, and records the files planted in the modules cache, so that
`revert` can restore the directory byte for byte. It is saved before every change, so a
crash half-way still reverts cleanly. How `journal.json` is read back and checked is in
journal/reader.py; what revert would do is decided in probe/revertplan.py.

A file that changed since fix last wrote it is the user's: a later fix takes it as the new
original, and revert leaves it alone and says so.

`revert` checks every entry first and only then changes files; if any check fails it
changes nothing and raises StateError naming the entry, why, and how to recover by hand.

In dry-run mode nothing is written: the planned writes are collected for display.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from qwen_kvprep.common import (
    JOURNAL_FILE,
    REGISTER_TRIES,
    STATE_DIRNAME,
    STATE_FILE,
    USERS_DIRNAME,
    modules_cache_root,
    user_record_name,
)
from qwen_kvprep.common import sha256_bytes as sha256
from qwen_kvprep.errors import StateError
from qwen_kvprep.findings import fail
from qwen_kvprep.fsutil import atomic_write_bytes, atomic_write_text
from qwen_kvprep.journal.reader import (
    ORIGINAL_LIMIT,
    ORIGINALS,
    PLANTABLE,
    STORE_NAME,
    WRITTEN_KEEP,
    Entry,
    JournalData,
    PlantedGroup,
    Present,
    empty_journal,
    folder_identity,
    link_advice,
    manual_recovery,
    present,
    read_journal,
    same_folder,
)
from qwen_kvprep.probe.revertplan import (
    Link,
    Remove,
    RemoveDir,
    Restore,
    RevertAction,
    RevertPlan,
    inherited,
    is_original,
    is_ours,
    plan_revert,
    prepared,
    read_user_records,
)
from qwen_kvprep.untrusted import NotRegularFile, open_dir_under, read_regular, relpath_problem

__all__ = [
    "JOURNAL_FILE",
    "STATE_DIRNAME",
    "USERS_DIRNAME",
    "Journal",
    "PlannedWrite",
    "remove_state_dir",
]


@dataclass(frozen=True)
class PlannedWrite:
    path: Path
    old: Optional[bytes]  # None: the file does not exist yet
    new: bytes


class Journal:
    def __init__(self, root: Path, dry_run: bool = False) -> None:
        self.root = Path(root)
        self.dry_run = dry_run
        self.state_dir = self.root / STATE_DIRNAME
        self.planned: list[PlannedWrite] = []
        # files that changed since fix wrote them, taken as their new originals
        self.retaken: list[str] = []
        # after revert: what was left alone, and why
        self.notes: list[str] = []
        self.identity = folder_identity(self.root)
        self._base = os.path.abspath(modules_cache_root()[0])  # of the last plant()
        self._data: JournalData = self._load()

    # -- persistence -------------------------------------------------------------------
    def _load(self) -> JournalData:
        return read_journal(self.root, Path(modules_cache_root()[0]))

    def _save(self) -> None:
        if self.dry_run:
            return
        self.state_dir.mkdir(exist_ok=True)
        atomic_write_text(
            self.state_dir / JOURNAL_FILE, json.dumps(self._data, indent=2, sort_keys=True) + "\n"
        )

    @property
    def exists(self) -> bool:
        return os.path.lexists(self.state_dir / JOURNAL_FILE)

    @property
    def changed_files(self) -> list[str]:
        return sorted(self._data["files"])

    @property
    def planted_files(self) -> list[str]:
        return sorted(
            os.path.join(g["root"], rel) for g in self._data["planted"] for rel in g["files"]
        )

    # -- recording ---------------------------------------------------------------------
    def _store(self, data: bytes) -> str:
        """Keep `data` under originals/ (named by its sha256); returns the store path."""
        digest = sha256(data)
        folder = self.state_dir / ORIGINALS
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / digest
        try:
            if sha256(read_regular(path, ORIGINAL_LIMIT, follow=False)) == digest:
                return f"{ORIGINALS}/{digest}"
        except OSError:
            pass
        atomic_write_bytes(path, data, 0o600)
        return f"{ORIGINALS}/{digest}"

    def _original(self, current: Present, path: Path) -> Entry:
        if current.kind == "symlink":
            assert current.target is not None
            return {"kind": "symlink", "target": current.target, "written": []}
        if current.kind == "file":
            assert current.data is not None
            try:
                mode = os.lstat(path).st_mode & 0o777
            except OSError:
                mode = 0o644
            return {
                "kind": "file",
                "store": self._store(current.data),
                "sha256": current.digest,
                "mode": mode,
                "written": [],
            }
        return {"kind": "absent", "written": []}

    def _write(
        self,
        table: dict[str, Entry],
        key: str,
        path: Path,
        data: bytes,
        mode: Optional[int],
        adopt: bool = False,
    ) -> bool:
        current = present(path)
        if current.kind == "other":
            raise NotRegularFile(path, current.what)
        entry = table.get(key)
        new = sha256(data)
        if current.kind == "file" and current.data == data:
            if self.dry_run:
                return False
            if adopt and entry is None:
                # planted by someone else (another folder of the same name): recorded so that
                # the last folder using it removes it, or puts back what was there before
                # the other folder planted it
                table[key] = self._inherit(path, key, current) or {
                    "kind": "absent",
                    "written": [new],
                    "adopted": True,
                }
                self._save()
            elif entry is not None and entry["written"] is not None and (
                new not in entry["written"] and not is_original(current, entry)
            ):
                entry["written"] = [*entry["written"][-(WRITTEN_KEEP - 1) :], new]
                self._save()  # what is there is what fix would write: fix's from now on
            return False
        if self.dry_run:
            self.planned.append(PlannedWrite(path, current.data, data))
            return True
        if (
            entry is not None
            and adopt
            and not is_ours(current, entry)
            and current.kind == "file"
            and (
                self._copied_from_us(path, current) is not None
                or self._inherit(path, key, current) is not None
            )
        ):
            # another prepared folder of the same name planted its copy over ours, or
            # transformers copied the checkpoint's file of ours there: not a user's file,
            # so ours to replace and, at the last revert, to remove
            assert current.digest is not None
            entry["written"] = [*(entry["written"] or []), current.digest][-WRITTEN_KEEP:]
        if entry is not None and not is_ours(current, entry):
            # changed since fix wrote it (a new upstream config.json, say): the user's file,
            # so it becomes the original revert brings back
            entry = None
            self.retaken.append(str(path))
        if entry is None and adopt and current.kind == "file":
            entry = self._inherit(path, key, current) or self._copied_from_us(path, current)
            if entry is not None:
                table[key] = entry
        if entry is None:
            entry = self._original(current, path)
            table[key] = entry
        # intent first: a crash after this leaves a file the journal still knows as ours
        written = [w for w in entry["written"] or [] if w != new][-(WRITTEN_KEEP - 1) :]
        written.append(new)
        entry["written"] = written
        self._save()
        atomic_write_bytes(path, data, mode)
        self._drop_unused_stores()
        return True

    def _inherit(self, path: Path, rel: str, current: Present) -> Optional[Entry]:
        """The entry for a modules-cache file another prepared folder of the same name
        planted: its original (not its copy) becomes ours, and what it wrote counts as
        ours, so the last of the two to be reverted leaves nothing of either behind."""
        assert current.digest is not None
        found = inherited(
            path.parent, rel, current.digest, self.identity, self.root, Path(self._base)
        )
        if found is None:
            return None
        theirs, original = found
        written = list(theirs["written"] or [])
        if theirs["kind"] == "file":
            assert original is not None
            entry: Entry = {
                "kind": "file",
                "store": self._store(original),
                "sha256": theirs.get("sha256"),
                "mode": theirs.get("mode"),
                "written": written,
            }
        elif theirs["kind"] == "symlink":
            entry = {"kind": "symlink", "target": theirs["target"], "written": written}
        else:
            entry = {"kind": "absent", "written": written, "adopted": True}
        return entry

    def _copied_from_us(self, path: Path, current: Present) -> Optional[Entry]:
        """A modules-cache file that is transformers' copy of what fix wrote in the
        checkpoint (it copies the checkpoint's cpp_kernels.py, and any .py the model code
        imports, at every load): not an original to bring back, so recorded as absent."""
        mine = self._data["files"].get(path.name)
        if mine is None or current.digest not in (mine["written"] or []):
            return None
        return {"kind": "absent", "written": [], "adopted": True}

    def _drop_unused_stores(self) -> None:
        used = {e["store"].split("/", 1)[1] for e in self._entries() if e["kind"] == "file"}
        folder = self.state_dir / ORIGINALS
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                if STORE_NAME.fullmatch(name) and name not in used:
                    os.unlink(folder / name)

    def _entries(self) -> list[Entry]:
        out = list(self._data["files"].values())
        for group in self._data["planted"]:
            out.extend(group["files"].values())
        return out

    def write(self, rel: str, data: bytes, mode: Optional[int] = None) -> bool:
        """Write `<root>/<rel>`, keeping its original once. Returns whether it changed."""
        why = relpath_problem(rel)
        if why is not None:
            raise ValueError(f"{rel!r} {why}")
        return self._write(self._data["files"], rel, self.root / rel, data, mode)

    def _group(self, root: str) -> PlantedGroup:
        for existing in self._data["planted"]:
            if existing["root"] == root and same_folder(existing["owner"], self.identity):
                return existing
        group: PlantedGroup = {"root": root, "owner": self.identity.copy(), "files": {}}
        if not self.dry_run:
            self._data["planted"].append(group)
        return group

    def plant(self, path: Path, data: bytes, root: Optional[Path] = None) -> bool:
        """Write a file in the modules cache (below `root`, by default the one the
        environment names), recorded for revert relative to that root. Only the files fix
        plants: a journal naming any other is refused when read back."""
        path = Path(os.path.abspath(path))
        if path.name not in PLANTABLE:
            raise ValueError(f"{path.name} is not a file fix plants")
        base = os.path.abspath(root if root is not None else modules_cache_root()[0])
        rel = os.path.relpath(path, base)
        why = relpath_problem(rel)
        if why is not None:
            raise ValueError(f"{path} is not inside the modules cache {base}")
        if not self.dry_run:
            path.parent.mkdir(parents=True, exist_ok=True)
        group = self._group(base)
        self._base = base
        return self._write(group["files"], rel, path, data, None, adopt=True)

    def register_user(self, folder: Path) -> None:
        """Record in a modules-cache folder that this checkpoint relies on what is there
        (and drop the records of folders that no longer do)."""
        if self.dry_run:
            return
        prune_users(folder)
        users = Path(folder) / USERS_DIRNAME
        if os.path.islink(users):
            raise OSError(errno.ELOOP, "is a symbolic link, not a folder of ours", str(users))
        me = users / user_record_name(self.identity["path"])
        text = json.dumps({"path": self.identity["path"]}) + "\n"
        try:
            if read_regular(me, 4096, follow=False).decode("utf-8", "replace") == text:
                return
        except OSError:
            pass
        for attempt in range(REGISTER_TRIES):
            users.mkdir(parents=True, exist_ok=True)
            try:
                atomic_write_text(me, text)
                return
            except FileNotFoundError:
                # Another checkpoint's fix sharing this folder (every checkpoint's `DIR/`
                # spelling runs from the package folder itself) pruned the records folder
                # while it was still empty; once our record is in it, no prune removes it.
                if attempt + 1 == REGISTER_TRIES:
                    raise

    def record_state_file(self, name: str, text: str) -> None:
        """Write a tool-owned file inside the state folder (removed by revert)."""
        if self.dry_run:
            return
        self.state_dir.mkdir(exist_ok=True)
        atomic_write_text(self.state_dir / name, text)

    # -- undo --------------------------------------------------------------------------
    def plan_revert(self) -> RevertPlan:
        """Check every entry; decide what to do. Changes nothing."""
        return plan_revert(self._data, self.root, self.identity, Path(modules_cache_root()[0]))

    def revert(self) -> list[str]:
        """Check every entry, then restore every recorded file and remove the state folder.
        Returns what was done; `self.notes` says what was left alone and why. Raises
        StateError, having changed nothing, when a check fails."""
        plan = self.plan_revert()
        self.notes = plan.notes
        if plan.problems:
            message = f"revert refused, nothing was changed: {plan.problems[0]}"
            if len(plan.problems) > 1:
                message += f" (and {len(plan.problems) - 1} more: " + "; ".join(
                    plan.problems[1:4]
                ) + ")"

            advice = (
                link_advice(plan.links, self.root)
                if plan.link_problems == len(plan.problems)
                else manual_recovery(self.state_dir)
            )
            raise StateError(
                message,
                fix=advice,
                findings=[fail("state.journal", p, advice) for p in plan.problems],
            )
        done: list[str] = []
        for description, action in plan.actions:
            if not isinstance(action, RemoveDir):
                _carry_out(action)
                done.append(description)
        for me, _folder in plan.users:
            _remove_record(me)
        for description, action in plan.actions:  # folders emptied by all of the above
            if isinstance(action, RemoveDir) and _remove_dir(action):
                done.append(description)
        remove_state_dir(self.state_dir)
        self._data = empty_journal()
        return done


def prune_users(folder: Path) -> list[str]:
    """Remove the records in a modules-cache folder's USERS_DIRNAME of folders that are no
    longer prepared (deleted, or reverted by a version that did not remove its record), and
    the records folder itself once empty. Returns the records removed."""
    removed: list[str] = []
    for record, path in read_user_records(folder):
        if not prepared(path):
            with contextlib.suppress(OSError):
                os.unlink(record)
                removed.append(str(record))
    with contextlib.suppress(OSError):
        os.rmdir(Path(folder) / USERS_DIRNAME)
    return removed


def _remove_record(record: Path) -> None:
    """Remove a record in a modules-cache folder's USERS_DIRNAME, and the records folder
    once empty, never through a link (a records folder linked elsewhere is not ours: a file
    of the same name there stays)."""
    try:
        fd = open_dir_under(record.parent.parent, [record.parent.name])
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.unlink(record.name, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(record.parent)  # only an empty folder; a link is not removed by rmdir


def remove_state_dir(state_dir: Path) -> None:
    """Remove `.qwen-kvprep/` (never following a link inside it), in an order that leaves
    a revert killed on the way recognisable: the state first (prestart must not trust it
    once the files are back), the journal last, so that what is left is a journal whose
    every file is already back as it was (doctor fails it, a new revert finishes it) or
    no journal and nothing of value (the lock, temporary files)."""
    if os.path.islink(state_dir):
        os.unlink(state_dir)
        return
    with contextlib.suppress(OSError):
        os.unlink(state_dir / STATE_FILE)
    shutil.rmtree(state_dir / ORIGINALS, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(state_dir / JOURNAL_FILE)
    shutil.rmtree(state_dir, ignore_errors=True)


def _tmp_name(name: str) -> str:
    # the pattern fsutil's temp files have, so a leftover one is recognised and removed
    return f".{name}.{secrets.token_hex(4)}.tmp"


def _carry_out(action: RevertAction) -> None:
    if isinstance(action, Remove):
        _remove(action)
    elif isinstance(action, Link):
        _link(action)
    elif isinstance(action, Restore):
        _restore(action)
    else:
        _remove_dir(action)


def _remove(action: Remove) -> None:
    try:
        fd = open_dir_under(action.base, action.parts[:-1])
    except FileNotFoundError:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(action.parts[-1], dir_fd=fd)
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_dir(action: RemoveDir) -> bool:
    """rmdir, which removes only an empty folder and never follows a symlink; False when
    something came in since the plan was made (it stays)."""
    try:
        fd = open_dir_under(action.base, action.parts[:-1])
    except OSError:
        return False
    try:
        os.rmdir(action.parts[-1], dir_fd=fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def _link(action: Link) -> None:
    def make(tmp: str, fd: int) -> None:
        os.symlink(action.target, tmp, dir_fd=fd)

    _put_back(action.base, action.parts, make)


def _restore(action: Restore) -> None:
    def make(tmp: str, fd: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        out = os.open(tmp, flags, 0o600, dir_fd=fd)
        try:
            view = memoryview(action.data)
            while view:
                view = view[os.write(out, view) :]
            os.fsync(out)
            os.fchmod(out, action.mode)
        finally:
            os.close(out)

    _put_back(action.base, action.parts, make)


def _put_back(base: Path, parts: list[str], make: Callable[[str, int], None]) -> None:
    """Put an entry at `base/parts`: `make(tmp, dir_fd)` creates it under a fresh temporary
    name in that folder, which one rename then moves over whatever is there, so a reader
    sees the old entry or the whole new one. On any failure the temporary entry goes."""
    fd = open_dir_under(base, parts[:-1], create=True)
    try:
        tmp = _tmp_name(parts[-1])
        try:
            make(tmp, fd)
            os.replace(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
        os.fsync(fd)
    finally:
        os.close(fd)
