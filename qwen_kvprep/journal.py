"""Every change qwen-kvprep makes to a checkpoint goes through a Journal.

The journal keeps each file's original once (bytes under `originals/`, named by their
sha256; the link target of a symlink; or the fact that it did not exist) under
`<checkpoint>/.qwen-kvprep/`, and records the files planted in the modules cache, so that
`revert` can restore the directory byte for byte. It is saved before every change, so a
crash half-way still reverts cleanly.

What is recorded is read back as data from a folder anyone with write access may have
changed (or copied elsewhere): `journal.json` is read with a size and depth limit and
checked against its schema; every path in it is relative and confined (to the checkpoint
for its files, to `originals/` for the stored originals, to the modules-cache root for
planted files) and reached without following a symlink; each original's sha256 is
recorded and verified before it is restored. Planted files are recorded relative to the
modules root together with the identity of the folder `fix` ran on, so reverting a copy
(`cp -a DIR COPY`) never removes what DIR's model still uses; each modules-cache folder
also lists the prepared folders that use it (`.qwen-kvprep-users/`), and a file another
prepared folder still uses stays.

A file that changed since fix last wrote it is the user's: a later fix takes it as the new
original, and revert leaves it alone and says so.

`revert` checks every entry first and only then changes files; if any check fails it
changes nothing and raises StateError naming the entry, why, and how to recover by hand.

In dry-run mode nothing is written: the planned writes are collected for display.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from qwen_kvprep.common import (
    JOURNAL_FILE,
    STATE_DIRNAME,
    STATE_FILE,
    USERS_DIRNAME,
    modules_cache_root,
    sha256_bytes,
    user_record_name,
)
from qwen_kvprep.errors import StateError
from qwen_kvprep.fsutil import atomic_write_bytes, atomic_write_text
from qwen_kvprep.untrusted import (
    RECORD_LIMIT,
    NotRegularFile,
    describe_json_error,
    lstat_at,
    open_dir_under,
    open_regular,
    read_fd,
    read_record,
    read_regular,
    relpath_problem,
)

JOURNAL_VERSION = 2
ORIGINALS = "originals"
# The files fix changes are a few KiB to a few hundred KiB.
ORIGINAL_LIMIT = 64 << 20
# How many versions fix wrote to one path are remembered as "ours".
_WRITTEN_KEEP = 8
_HEX64 = re.compile(r"[0-9a-f]{64}")
_STORE_NAME = re.compile(r"[0-9a-f]{16}|[0-9a-f]{64}")  # version 1 used 16 hex digits
_KINDS = ("file", "symlink", "absent")


@dataclass(frozen=True)
class PlannedWrite:
    path: Path
    old: Optional[bytes]  # None: the file does not exist yet
    new: bytes


def _q(path: Any) -> str:
    return shlex.quote(str(path))


def folder_identity(directory: Path) -> dict[str, Any]:
    """What identifies a prepared folder: its absolute path and its inode."""
    path = os.path.abspath(directory)
    try:
        st = os.stat(path)
        dev, ino = st.st_dev, st.st_ino
    except OSError:
        dev, ino = -1, -1
    return {"path": path, "dev": dev, "ino": ino}


def same_folder(owner: dict[str, Any], identity: dict[str, Any]) -> bool:
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
        return sha256_bytes(self.data) if self.data is not None else None


def present_at(fd: int, name: str) -> Present:
    """What `name` in the folder `fd` holds; the entry itself, never followed."""
    st = lstat_at(fd, name)
    if st is None:
        return Present("absent")
    if stat.S_ISLNK(st.st_mode):
        return Present("symlink", target=os.readlink(name, dir_fd=fd))
    if not stat.S_ISREG(st.st_mode):
        from qwen_kvprep.untrusted import kind_of

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


class _Invalid(Exception):
    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where} {why}")
        self.where = where
        self.why = why


def _check_entry(entry: Any, where: str, version: int) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise _Invalid(where, "is not an object")
    kind = entry.get("kind")
    if kind not in _KINDS:
        raise _Invalid(where, f"has an unknown kind {kind!r}")
    out: dict[str, Any] = {"kind": kind}
    if kind == "file":
        store = entry.get("store")
        why = relpath_problem(store)
        if why is None:
            parts = str(store).split("/")
            if len(parts) != 2 or parts[0] != ORIGINALS or not _STORE_NAME.fullmatch(parts[1]):
                why = f"is not a file directly in {ORIGINALS}/"
        if why is not None:
            raise _Invalid(where, f"keeps its original at {store!r}, which {why}")
        out["store"] = store
        digest = entry.get("sha256")
        if (version >= 2 or digest is not None) and (
            not isinstance(digest, str) or not _HEX64.fullmatch(digest)
        ):
            raise _Invalid(where, "has no valid sha256 of its original")
        out["sha256"] = digest
        mode = entry.get("mode")
        if mode is not None and (
            not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777
        ):
            raise _Invalid(where, f"has an invalid mode {mode!r}")
        out["mode"] = mode
    elif kind == "symlink":
        target = entry.get("target")
        if not isinstance(target, str) or not target or "\x00" in target or len(target) > 4096:
            raise _Invalid(where, "has no valid symlink target")
        out["target"] = target
    written = entry.get("written")
    if written is None:
        # version 1 did not record what fix wrote: whatever is there counts as fix's
        out["written"] = None
    elif not isinstance(written, list) or not all(
        isinstance(w, str) and _HEX64.fullmatch(w) for w in written
    ):
        raise _Invalid(where, "has an invalid list of written sha256")
    else:
        out["written"] = list(written)[-_WRITTEN_KEEP:]
    if entry.get("adopted") is True:
        out["adopted"] = True
    return out


def _check_table(table: Any, where: str, version: int) -> dict[str, dict[str, Any]]:
    if not isinstance(table, dict):
        raise _Invalid(where, "is not an object")
    out = {}
    for rel, entry in table.items():
        why = relpath_problem(rel)
        if why is not None:
            raise _Invalid(f"{where} entry {rel!r}", why)
        out[rel] = _check_entry(entry, f"{where} entry {rel!r}", version)
    return out


def _check_owner(owner: Any, where: str) -> dict[str, Any]:
    if not isinstance(owner, dict):
        raise _Invalid(where, "has no owner")
    path, dev, ino = owner.get("path"), owner.get("dev"), owner.get("ino")
    if not isinstance(path, str) or not os.path.isabs(path) or "\x00" in path:
        raise _Invalid(where, "has an owner without an absolute path")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (dev, ino)):
        raise _Invalid(where, "has an owner without a device and inode")
    return {"path": os.path.normpath(path), "dev": dev, "ino": ino}


def _check_groups(groups: Any, version: int) -> list[dict[str, Any]]:
    if not isinstance(groups, list):
        raise _Invalid("planted", "is not a list")
    out = []
    for i, group in enumerate(groups):
        where = f"planted[{i}]"
        if not isinstance(group, dict):
            raise _Invalid(where, "is not an object")
        root = group.get("root")
        if not isinstance(root, str) or not os.path.isabs(root) or "\x00" in root:
            raise _Invalid(where, "has no absolute modules-cache root")
        out.append(
            {
                "root": os.path.normpath(root),
                "owner": _check_owner(group.get("owner"), where),
                "files": _check_table(group.get("files"), f"{where} files", version),
            }
        )
    return out


def _from_version_1(data: dict[str, Any], directory: Path) -> dict[str, Any]:
    """Version 1 recorded planted files by absolute path: they are taken relative to this
    environment's modules root (anything else is refused), owned by `directory`."""
    files = _check_table(data.get("files", {}), "files", 1)
    planted = data.get("planted", {})
    if not isinstance(planted, dict):
        raise _Invalid("planted", "is not an object")
    root = os.path.abspath(modules_cache_root()[0])
    group: dict[str, Any] = {}
    for key, entry in planted.items():
        where = f"planted entry {key!r}"
        if not isinstance(key, str) or not os.path.isabs(key):
            raise _Invalid(where, "is not an absolute path")
        rel = os.path.relpath(os.path.normpath(key), root)
        why = relpath_problem(rel)
        if why is not None:
            raise _Invalid(where, f"is outside the modules cache {root}")
        group[rel] = _check_entry(entry, where, 1)
    groups = []
    if group:
        groups.append({"root": root, "owner": folder_identity(directory), "files": group})
    return {"version": JOURNAL_VERSION, "files": files, "planted": groups}


def check_journal(data: Any, directory: Path) -> dict[str, Any]:
    """The journal's content in normal form; _Invalid names the entry that is wrong."""
    if not isinstance(data, dict):
        raise _Invalid("the journal", "is not a JSON object")
    version = data.get("version")
    if version == 1:
        return _from_version_1(data, directory)
    if version != JOURNAL_VERSION:
        raise _Invalid("the journal", f"has version {version!r}, not {JOURNAL_VERSION}")
    return {
        "version": JOURNAL_VERSION,
        "files": _check_table(data.get("files"), "files", JOURNAL_VERSION),
        "planted": _check_groups(data.get("planted"), JOURNAL_VERSION),
    }


def journal_problem(directory: Path) -> Optional[str]:
    """Why DIR's journal cannot be used (None: it is fine or there is none). For doctor."""
    try:
        Journal(directory, dry_run=True)
    except StateError as exc:
        return exc.message
    return None


def _manual_recovery(state_dir: Path) -> str:
    return (
        f"nothing was changed. Restore by hand what you need: the originals fix replaced are "
        f"in {_q(state_dir / ORIGINALS)} (named by their sha256; `sha256sum` them), "
        f"{_q(state_dir / JOURNAL_FILE)} says which file each one was; then remove "
        f"{_q(state_dir)}"
    )


# ------------------------------------------------------------------ the journal


@dataclass
class RevertPlan:
    """What revert will do, decided before anything is changed."""

    actions: list[tuple[str, Any]] = field(default_factory=list)  # (description, callable)
    notes: list[str] = field(default_factory=list)  # what is left alone, and why
    problems: list[str] = field(default_factory=list)  # why revert must change nothing
    users: list[tuple[Path, str]] = field(default_factory=list)  # registry files to remove


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
        self._data: dict[str, Any] = self._load()

    # -- persistence -------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        path = self.state_dir / JOURNAL_FILE
        try:
            raw = read_record(path, RECORD_LIMIT)
            return check_journal(raw, self.root)
        except FileNotFoundError:
            return {"version": JOURNAL_VERSION, "files": {}, "planted": []}
        except _Invalid as exc:
            raise StateError(
                f"the journal {path} is damaged or was edited: {exc}",
                fix=_manual_recovery(self.state_dir),
            ) from None
        except (OSError, ValueError) as exc:
            raise StateError(
                f"the journal {path} {describe_json_error(exc)}",
                fix=_manual_recovery(self.state_dir),
            ) from None

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
        digest = sha256_bytes(data)
        folder = self.state_dir / ORIGINALS
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / digest
        try:
            if sha256_bytes(read_regular(path, ORIGINAL_LIMIT, follow=False)) == digest:
                return f"{ORIGINALS}/{digest}"
        except OSError:
            pass
        atomic_write_bytes(path, data, 0o600)
        return f"{ORIGINALS}/{digest}"

    def _original(self, current: Present, path: Path) -> dict[str, Any]:
        if current.kind == "symlink":
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

    @staticmethod
    def _is_original(current: Present, entry: dict[str, Any]) -> bool:
        kind = entry["kind"]
        if kind == "absent":
            return current.kind == "absent"
        if kind == "symlink":
            return current.kind == "symlink" and current.target == entry["target"]
        return current.kind == "file" and current.digest == entry.get("sha256")

    @classmethod
    def _is_ours(cls, current: Present, entry: dict[str, Any]) -> bool:
        """Whether `current` is what fix wrote (or still the original)."""
        written = entry["written"]
        if written is None:  # not recorded (version 1): assume it is
            return current.kind == "file"
        if current.kind == "file" and current.digest in written:
            return True
        return cls._is_original(current, entry)

    def _write(
        self,
        table: dict[str, Any],
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
        new = sha256_bytes(data)
        if current.kind == "file" and current.data == data:
            if self.dry_run:
                return False
            if adopt and entry is None:
                # planted by someone else (another folder of the same name): recorded so that
                # the last folder using it removes it
                table[key] = {"kind": "absent", "written": [new], "adopted": True}
                self._save()
            elif entry is not None and entry["written"] is not None and (
                new not in entry["written"] and not self._is_original(current, entry)
            ):
                entry["written"] = [*entry["written"][-(_WRITTEN_KEEP - 1) :], new]
                self._save()  # what is there is what fix would write: fix's from now on
            return False
        if self.dry_run:
            self.planned.append(PlannedWrite(path, current.data, data))
            return True
        if entry is not None and not self._is_ours(current, entry):
            # changed since fix wrote it (a new upstream config.json, say): the user's file,
            # so it becomes the original revert brings back
            entry = None
            self.retaken.append(str(path))
        if entry is None:
            entry = self._original(current, path)
            table[key] = entry
        # intent first: a crash after this leaves a file the journal still knows as ours
        entry["written"] = [w for w in entry["written"] or [] if w != new][-(_WRITTEN_KEEP - 1) :]
        entry["written"].append(new)
        self._save()
        atomic_write_bytes(path, data, mode)
        self._drop_unused_stores()
        return True

    def _drop_unused_stores(self) -> None:
        used = {e["store"].split("/", 1)[1] for e in self._entries() if e["kind"] == "file"}
        folder = self.state_dir / ORIGINALS
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                if _STORE_NAME.fullmatch(name) and name not in used:
                    os.unlink(folder / name)

    def _entries(self) -> list[dict[str, Any]]:
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

    def _group(self, root: str) -> dict[str, Any]:
        for group in self._data["planted"]:
            if group["root"] == root and same_folder(group["owner"], self.identity):
                return group
        group = {"root": root, "owner": dict(self.identity), "files": {}}
        if not self.dry_run:
            self._data["planted"].append(group)
        return group

    def plant(self, path: Path, data: bytes, root: Optional[Path] = None) -> bool:
        """Write a file in the modules cache (below `root`, by default the one the
        environment names), recorded for revert relative to that root."""
        path = Path(os.path.abspath(path))
        base = os.path.abspath(root if root is not None else modules_cache_root()[0])
        rel = os.path.relpath(path, base)
        why = relpath_problem(rel)
        if why is not None:
            raise ValueError(f"{path} is not inside the modules cache {base}")
        if not self.dry_run:
            path.parent.mkdir(parents=True, exist_ok=True)
        group = self._group(base)
        return self._write(group["files"], rel, path, data, None, adopt=True)

    def register_user(self, folder: Path) -> None:
        """Record in a modules-cache folder that this checkpoint relies on what is there."""
        if self.dry_run:
            return
        users = Path(folder) / USERS_DIRNAME
        users.mkdir(parents=True, exist_ok=True)
        me = users / user_record_name(self.identity["path"])
        text = json.dumps({"path": self.identity["path"]}) + "\n"
        try:
            if read_regular(me, 4096, follow=False).decode("utf-8", "replace") == text:
                return
        except OSError:
            pass
        atomic_write_text(me, text)

    def record_state_file(self, name: str, text: str) -> None:
        """Write a tool-owned file inside the state folder (removed by revert)."""
        if self.dry_run:
            return
        self.state_dir.mkdir(exist_ok=True)
        atomic_write_text(self.state_dir / name, text)

    # -- undo --------------------------------------------------------------------------
    def plan_revert(self) -> RevertPlan:
        """Check every entry; decide what to do. Changes nothing."""
        plan = RevertPlan()
        for rel in sorted(self._data["files"]):
            self._plan_entry(plan, self.root, rel, self._data["files"][rel], rel)
        self._plan_planted(plan)
        return plan

    def _plan_planted(self, plan: RevertPlan) -> None:
        here = os.path.abspath(modules_cache_root()[0])
        for group in self._data["planted"]:
            owner = group["owner"]
            files = group["files"]
            if not files:
                continue
            if not same_folder(owner, self.identity) and _prepared(owner["path"]):
                plan.notes.append(
                    f"{len(files)} modules-cache file(s) planted for {owner['path']}: left "
                    "there, that folder is still prepared (this one is a copy of it)"
                )
                continue
            root = group["root"]
            if os.path.realpath(root) != os.path.realpath(here):
                kept = [rel for rel, e in files.items() if e["kind"] != "absent"]
                if kept:
                    plan.problems.append(
                        f"{os.path.join(root, kept[0])} was planted in the modules cache "
                        f"{root}, not this environment's {here}; its original is kept in the "
                        "journal and can only be restored there: run "
                        f"`HF_MODULES_CACHE={_q(root)} qwen-kvprep revert {_q(self.root)}`"
                    )
                    continue
                plan.notes.append(
                    f"{len(files)} file(s) fix planted in the modules cache {root} (not this "
                    f"environment's {here}) are left there: remove them with "
                    + " ".join(["rm -f", *(_q(os.path.join(root, r)) for r in sorted(files))])
                )
                continue
            by_folder: dict[str, list[str]] = {}
            for rel in files:
                by_folder.setdefault(os.path.dirname(rel), []).append(rel)
            for folder_rel, rels in sorted(by_folder.items()):
                folder = Path(here) / folder_rel
                others = self._other_users(folder)
                if others:
                    plan.notes.append(
                        f"{folder}: {', '.join(os.path.basename(r) for r in sorted(rels))} "
                        f"left there, {others[0]} still uses them"
                    )
                else:
                    for rel in sorted(rels):
                        self._plan_entry(plan, Path(here), rel, files[rel], str(Path(here) / rel))
                me = folder / USERS_DIRNAME / user_record_name(self.identity["path"])
                plan.users.append((me, str(folder)))

    def _other_users(self, folder: Path) -> list[str]:
        """Prepared folders other than this one registered in a modules-cache folder."""
        users = folder / USERS_DIRNAME
        try:
            names = sorted(os.listdir(users))
        except OSError:
            return []
        out = []
        for name in names:
            try:
                data = json.loads(read_regular(users / name, 4096, follow=False))
            except (OSError, ValueError):
                continue
            path = data.get("path") if isinstance(data, dict) else None
            if not isinstance(path, str) or name != user_record_name(path):
                continue
            if path == self.identity["path"] or os.path.realpath(path) == os.path.realpath(
                self.root
            ):
                continue
            if _prepared(path):
                out.append(path)
        return out

    def _plan_entry(
        self, plan: RevertPlan, base: Path, rel: str, entry: dict[str, Any], shown: str
    ) -> None:
        parts = rel.split("/")
        name = parts[-1]
        try:
            fd = open_dir_under(base, parts[:-1])
        except FileNotFoundError:
            fd = -1
        except OSError as exc:
            plan.problems.append(
                f"{shown}: its folder cannot be reached without following a symlink or "
                f"leaving {base} ({exc.strerror or exc})"
            )
            return
        try:
            current = present_at(fd, name) if fd >= 0 else Present("absent")
        except OSError as exc:
            plan.problems.append(f"{shown} cannot be read: {exc.strerror or exc}")
            return
        finally:
            if fd >= 0:
                os.close(fd)
        if self._is_original(current, entry):
            plan.notes.append(f"{shown}: already as it was before fix")
            return
        if not self._is_ours(current, entry):
            if entry.get("adopted") or current.kind == "absent":
                what = "is gone" if current.kind == "absent" else "was replaced"
                plan.notes.append(f"{shown} {what} since fix: left as it is")
            else:
                plan.notes.append(
                    f"{shown} changed since fix wrote it: left as it is (yours now; the "
                    "version from before fix is not brought back)"
                )
            return
        kind = entry["kind"]
        if kind == "absent":
            plan.actions.append(
                (f"{shown} (removed: it did not exist before)", _Remove(base, parts))
            )
            return
        if kind == "symlink":
            plan.actions.append(
                (f"{shown} (symlink to {entry['target']})", _Link(base, parts, entry["target"]))
            )
            return
        store = entry["store"]
        store_path = self.state_dir / store
        try:
            sfd = open_dir_under(self.state_dir, [ORIGINALS])
            try:
                ofd = open_regular(store.split("/")[1], follow=False, dir_fd=sfd)
                try:
                    store_mode = os.fstat(ofd).st_mode & 0o777
                    data = read_fd(ofd, ORIGINAL_LIMIT, store_path)
                finally:
                    os.close(ofd)
            finally:
                os.close(sfd)
        except FileNotFoundError:
            plan.problems.append(
                f"{shown}: its original {store_path} is missing (deleted, or the folder was "
                "copied without it), so it cannot be restored"
            )
            return
        except NotRegularFile as exc:
            plan.problems.append(f"{shown}: its original {store_path} {exc.strerror}")
            return
        except OSError as exc:
            plan.problems.append(
                f"{shown}: its original {store_path} cannot be read safely "
                f"({exc.strerror or exc})"
            )
            return
        digest = entry.get("sha256")
        if digest is not None and sha256_bytes(data) != digest:
            plan.problems.append(
                f"{shown}: its original {store_path} changed since fix kept it (sha256 "
                f"{sha256_bytes(data)[:16]}…, recorded {digest[:16]}…), so it is not restored"
            )
            return
        mode = entry.get("mode")  # version 1 kept it on the stored copy instead
        plan.actions.append(
            (shown, _Restore(base, parts, data, store_mode if mode is None else mode & 0o777))
        )

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
            from qwen_kvprep.findings import fail

            raise StateError(
                message,
                fix=_manual_recovery(self.state_dir),
                findings=[
                    fail("state.journal", p, _manual_recovery(self.state_dir))
                    for p in plan.problems
                ],
            )
        done: list[str] = []
        for description, action in plan.actions:
            action()
            done.append(description)
        for me, _folder in plan.users:
            with contextlib.suppress(OSError):
                os.unlink(me)
            with contextlib.suppress(OSError):
                os.rmdir(me.parent)
        remove_state_dir(self.state_dir)
        self._data = {"version": JOURNAL_VERSION, "files": {}, "planted": []}
        return done


def _prepared(path: str) -> bool:
    """Whether the folder at `path` still holds what fix recorded (its state or journal)."""
    base = os.path.join(path, STATE_DIRNAME)
    return any(os.path.isfile(os.path.join(base, n)) for n in (JOURNAL_FILE, STATE_FILE))


def remove_state_dir(state_dir: Path) -> None:
    """Remove `.qwen-kvprep/` (never following a link inside it)."""
    if os.path.islink(state_dir):
        os.unlink(state_dir)
        return
    shutil.rmtree(state_dir, ignore_errors=True)


def _tmp_name(name: str) -> str:
    # the pattern fsutil's temp files have, so a leftover one is recognised and removed
    return f".{name}.{secrets.token_hex(4)}.tmp"


class _Remove:
    def __init__(self, base: Path, parts: list[str]) -> None:
        self.base, self.parts = base, parts

    def __call__(self) -> None:
        try:
            fd = open_dir_under(self.base, self.parts[:-1])
        except FileNotFoundError:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.parts[-1], dir_fd=fd)
            os.fsync(fd)
        finally:
            os.close(fd)


class _Link:
    def __init__(self, base: Path, parts: list[str], target: str) -> None:
        self.base, self.parts, self.target = base, parts, target

    def __call__(self) -> None:
        fd = open_dir_under(self.base, self.parts[:-1], create=True)
        try:
            tmp = _tmp_name(self.parts[-1])
            os.symlink(self.target, tmp, dir_fd=fd)
            try:
                os.replace(tmp, self.parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                raise
            os.fsync(fd)
        finally:
            os.close(fd)


class _Restore:
    def __init__(self, base: Path, parts: list[str], data: bytes, mode: int) -> None:
        self.base, self.parts, self.data, self.mode = base, parts, data, mode

    def __call__(self) -> None:
        fd = open_dir_under(self.base, self.parts[:-1], create=True)
        try:
            tmp = _tmp_name(self.parts[-1])
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            out = os.open(tmp, flags, 0o600, dir_fd=fd)
            try:
                try:
                    view = memoryview(self.data)
                    while view:
                        view = view[os.write(out, view) :]
                    os.fsync(out)
                    os.fchmod(out, self.mode)
                finally:
                    os.close(out)
                os.replace(tmp, self.parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                raise
            os.fsync(fd)
        finally:
            os.close(fd)

