"""journal.json read back: its schema, and what `revert` would do, decided without
changing anything.

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

`plan_revert` checks every entry and returns what revert would do, what it would leave
and why, and the problems that make it refuse: doctor reports that plan, and
journal.Journal carries it out.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional, TypedDict, Union

from qwen_kvprep.common import (
    JOURNAL_FILE,
    STATE_DIRNAME,
    USERS_DIRNAME,
    user_record_name,
)
from qwen_kvprep.common import sha256_bytes as sha256
from qwen_kvprep.errors import StateError
from qwen_kvprep.untrusted import (
    RECORD_LIMIT,
    NotRegularFile,
    describe_json_error,
    kind_of,
    lstat_at,
    open_dir_under,
    open_regular,
    read_fd,
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


class Identity(TypedDict):
    """What identifies a prepared folder: its absolute path and its inode."""

    path: str
    dev: int
    ino: int


class PlantedGroup(TypedDict):
    """The files fix planted below one modules-cache root for one prepared folder."""

    root: str  # absolute
    owner: Identity
    files: dict[str, Entry]  # relative to root


class JournalData(TypedDict):
    """The journal in normal form, as check_journal returns it."""

    version: int
    files: dict[str, Entry]  # relative to the checkpoint
    planted: list[PlantedGroup]


def quote(path: object) -> str:
    return shlex.quote(str(path))


def folder_identity(directory: Path) -> Identity:
    """What identifies a prepared folder: its absolute path and its inode."""
    path = os.path.abspath(directory)
    try:
        st = os.stat(path)
        dev, ino = st.st_dev, st.st_ino
    except OSError:
        dev, ino = -1, -1
    return {"path": path, "dev": dev, "ino": ino}


def same_folder(owner: Identity, identity: Identity) -> bool:
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


def _check_owner(owner: JSON, where: str) -> Identity:
    if not isinstance(owner, dict):
        raise Invalid(where, "has no owner")
    path, dev, ino = owner.get("path"), owner.get("dev"), owner.get("ino")
    if not isinstance(path, str) or not os.path.isabs(path) or "\x00" in path:
        raise Invalid(where, "has an owner without an absolute path")
    if not (_integer(dev) and _integer(ino)):
        raise Invalid(where, "has an owner without a device and inode")
    return {"path": os.path.normpath(path), "dev": dev, "ino": ino}


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
                "files": _check_table(group.get("files"), f"{where} files", version),
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


def manual_recovery(state_dir: Path) -> str:
    return (
        f"nothing was changed. Restore by hand what you need: the originals fix replaced are "
        f"in {quote(state_dir / ORIGINALS)} (named by their sha256; `sha256sum` them), "
        f"{quote(state_dir / JOURNAL_FILE)} says which file each one was; then remove "
        f"{quote(state_dir)}"
    )


# ------------------------------------------------------------------ what revert would do


def is_original(current: Present, entry: Entry) -> bool:
    """Whether `current` is what was there before fix (the recorded original)."""
    kind = entry["kind"]
    if kind == "absent":
        return current.kind == "absent"
    if kind == "symlink":
        return current.kind == "symlink" and current.target == entry["target"]
    return current.kind == "file" and current.digest == entry.get("sha256")


def is_ours(current: Present, entry: Entry) -> bool:
    """Whether `current` is what fix wrote (or still the original)."""
    written = entry["written"]
    if written is None:  # not recorded (version 1): assume it is
        return current.kind == "file"
    if current.kind == "file" and current.digest in written:
        return True
    return is_original(current, entry)


@dataclass(frozen=True)
class Remove:
    """Remove `base/parts` (it did not exist before fix)."""

    base: Path
    parts: list[str]


@dataclass(frozen=True)
class Link:
    """Put the symlink to `target` back at `base/parts`."""

    base: Path
    parts: list[str]
    target: str


@dataclass(frozen=True)
class Restore:
    """Put the original bytes back at `base/parts`, with their mode."""

    base: Path
    parts: list[str]
    data: bytes
    mode: int


RevertAction = Union[Remove, Link, Restore]


@dataclass
class RevertPlan:
    """What revert will do, decided before anything is changed."""

    actions: list[tuple[str, RevertAction]] = field(default_factory=list)  # (description, what)
    notes: list[str] = field(default_factory=list)  # what is left alone, and why
    problems: list[str] = field(default_factory=list)  # why revert must change nothing
    users: list[tuple[Path, str]] = field(default_factory=list)  # registry files to remove


def plan_revert(
    data: JournalData, root: Path, identity: Identity, modules_root: Path
) -> RevertPlan:
    """Check every entry of `data` (the journal of the folder `root`, whose identity is
    `identity`, as read_journal returns it) and decide what revert would do, with this
    environment's modules-cache root `modules_root`. Changes nothing."""
    planner = _Planner(data, Path(root), identity, os.path.abspath(modules_root))
    plan = RevertPlan()
    for rel in sorted(data["files"]):
        planner.entry(plan, planner.root, rel, data["files"][rel], rel)
    planner.planted(plan)
    return plan


class _Planner:
    def __init__(self, data: JournalData, root: Path, identity: Identity, here: str) -> None:
        self.data = data
        self.root = root
        self.identity = identity
        self.here = here
        self.state_dir = root / STATE_DIRNAME

    def planted(self, plan: RevertPlan) -> None:
        here = self.here
        for group in self.data["planted"]:
            owner = group["owner"]
            files = group["files"]
            if not files:
                continue
            if not same_folder(owner, self.identity) and prepared(owner["path"]):
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
                        f"`HF_MODULES_CACHE={quote(root)} qwen-kvprep revert {quote(self.root)}`"
                    )
                    continue
                plan.notes.append(
                    f"{len(files)} file(s) fix planted in the modules cache {root} (not this "
                    f"environment's {here}) are left there: remove them with "
                    + " ".join(["rm -f", *(quote(os.path.join(root, r)) for r in sorted(files))])
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
                    for rel in sorted(rels):
                        self._give_back(plan, Path(here), rel, others)
                else:
                    for rel in sorted(rels):
                        self.entry(plan, Path(here), rel, files[rel], str(Path(here) / rel))
                me = folder / USERS_DIRNAME / user_record_name(self.identity["path"])
                for record in {me, *user_records(folder, self.identity, self.root)[0]}:
                    plan.users.append((record, str(folder)))

    def _other_users(self, folder: Path) -> list[str]:
        """Prepared folders other than this one registered in a modules-cache folder."""
        return [p for p in user_records(folder, self.identity, self.root)[1] if prepared(p)]

    def _give_back(self, plan: RevertPlan, here: Path, rel: str, others: list[str]) -> None:
        """A file this folder planted over another prepared folder's copy, in a folder both
        use: put that folder's own copy back (fix plants the checkpoint's own files, so it
        is in the checkpoint), so that its journal knows the file as its own and its
        revert removes it."""
        parts = rel.split("/")
        try:
            current = present_at_path(here, parts)
        except OSError:
            return
        for other in others:
            try:
                data = read_journal(Path(other), Path(here))
            except StateError:
                continue
            for group in data["planted"]:
                entry = group["files"].get(rel)
                if entry is None or os.path.realpath(group["root"]) != os.path.realpath(here):
                    continue
                written = entry["written"] or []
                if current.kind == "file" and current.digest in written:
                    return  # already theirs
                try:
                    mine = read_regular(Path(other) / parts[-1], ORIGINAL_LIMIT, follow=False)
                except OSError:
                    continue
                if sha256(mine) in written:
                    plan.actions.append(
                        (
                            f"{here / rel} (put back as {other}, which still uses it, planted it)",
                            Restore(here, parts, mine, 0o644),
                        )
                    )
                    return

    def entry(
        self, plan: RevertPlan, base: Path, rel: str, entry: Entry, shown: str
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
        if is_original(current, entry):
            plan.notes.append(f"{shown}: already as it was before fix")
            return
        if not is_ours(current, entry):
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
                (f"{shown} (removed: it did not exist before)", Remove(base, parts))
            )
            return
        if kind == "symlink":
            plan.actions.append(
                (f"{shown} (symlink to {entry['target']})", Link(base, parts, entry["target"]))
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
        if digest is not None and sha256(data) != digest:
            plan.problems.append(
                f"{shown}: its original {store_path} changed since fix kept it (sha256 "
                f"{sha256(data)[:16]}…, recorded {digest[:16]}…), so it is not restored"
            )
            return
        mode = entry.get("mode")  # version 1 kept it on the stored copy instead
        plan.actions.append(
            (shown, Restore(base, parts, data, store_mode if mode is None else mode & 0o777))
        )


def read_user_records(folder: Path) -> list[tuple[Path, str]]:
    """(record, the prepared folder it names) for each record in a modules-cache folder's
    USERS_DIRNAME, in name order; unreadable records, and records not named after the
    folder they name, are skipped (bounded reads: the folder is shared)."""
    users = Path(folder) / USERS_DIRNAME
    try:
        names = sorted(os.listdir(users))
    except OSError:
        return []
    found: list[tuple[Path, str]] = []
    for name in names:
        try:
            data = json.loads(read_regular(users / name, 4096, follow=False))
        except (OSError, ValueError):
            continue
        path = data.get("path") if isinstance(data, dict) else None
        if isinstance(path, str) and name == user_record_name(path):
            found.append((users / name, path))
    return found


def user_records(folder: Path, identity: Identity, root: Path) -> tuple[list[Path], list[str]]:
    """The records in a modules-cache folder's USERS_DIRNAME: (this folder's own, under
    any spelling of its path: a fix through a symlink and a revert through the real path
    must find each other's; the other folders' paths)."""
    mine: list[Path] = []
    others: list[str] = []
    real = os.path.realpath(root)
    for record, path in read_user_records(folder):
        if path == identity["path"] or os.path.realpath(path) == real:
            mine.append(record)
        else:
            others.append(path)
    return mine, others


def inherited(
    folder: Path, rel: str, digest: str, identity: Identity, root: Path, modules_root: Path
) -> Optional[tuple[Entry, Optional[bytes]]]:
    """When the file `rel` (relative to `modules_root`) in the modules-cache `folder`
    holds `digest` because another prepared folder of the same name planted it there:
    that folder's journal entry for it and the bytes of its original (None unless a
    file). A fix planting over it takes that original as its own, so whichever of the
    two is reverted last restores what was there before either, not the other's copy."""
    for other in user_records(folder, identity, root)[1]:
        if not prepared(other):
            continue
        try:
            data = read_journal(Path(other), modules_root)
        except StateError:
            continue
        for group in data["planted"]:
            if os.path.realpath(group["root"]) != os.path.realpath(modules_root):
                continue
            entry = group["files"].get(rel)
            if entry is None or digest not in (entry["written"] or []):
                continue
            if entry["kind"] != "file":
                return entry, None
            try:
                original = read_regular(
                    Path(other) / STATE_DIRNAME / entry["store"], ORIGINAL_LIMIT, follow=False
                )
            except OSError:
                continue
            if entry.get("sha256") not in (None, sha256(original)):
                continue
            return entry, original
    return None


def present_at_path(base: Path, parts: list[str]) -> Present:
    """What `base/parts` holds, reached without following a symlink below `base`."""
    try:
        fd = open_dir_under(base, parts[:-1])
    except FileNotFoundError:
        return Present("absent")
    try:
        return present_at(fd, parts[-1])
    finally:
        os.close(fd)


def prepared(path: str) -> bool:
    """Whether the folder at `path` still holds what fix recorded (its state or journal)."""
    base = os.path.join(path, STATE_DIRNAME)
    return any(os.path.isfile(os.path.join(base, n)) for n in (JOURNAL_FILE, "state.json"))
