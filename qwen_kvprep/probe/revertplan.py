"""What `revert` would do, decided from the journal (journal/reader.py) and what is on disk
now, without changing anything: doctor reports this plan, and journal.Journal carries it
out. Every original's sha256 is verified before revert would restore it; a planted file
another prepared folder still uses (its `.qwen-kvprep-users/` record) stays.

modeling_qwen.py is the one file fix changes by adding marked lines (compat.py, fastkv.py):
those are ours to take out, every other line is the user's. When it still holds them,
revert takes out exactly those and keeps the rest, so an edit the user made after fix
survives (when nothing else changed, that is the original, which is restored byte for
byte); marker lines that were edited make revert refuse, naming the line."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from qwen_kvprep import compat
from qwen_kvprep.common import (
    JOURNAL_FILE,
    MODELING_FILE,
    STATE_DIRNAME,
    USERS_DIRNAME,
    user_record_name,
)
from qwen_kvprep.common import sha256_bytes as sha256
from qwen_kvprep.errors import StateError
from qwen_kvprep.probe.modcopies import HASH_FOLDER, PYCACHE, bytecode, copies, left_empty
from qwen_kvprep.untrusted import (
    NotRegularFile,
    lstat_at,
    open_dir_under,
    open_regular,
    read_fd,
    read_regular,
)

if TYPE_CHECKING:

    pass
from qwen_kvprep.journal.reader import (
    ORIGINAL_LIMIT,
    ORIGINALS,
    Entry,
    FolderIdentity,
    JournalData,
    Present,
    present_at,
    quote,
    read_journal,
    same_folder,
)


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


@dataclass(frozen=True)
class RemoveDir:
    """Remove the folder `base/parts` once it is empty (after the records are removed)."""

    base: Path
    parts: list[str]


RevertAction = Union[Remove, Link, Restore, RemoveDir]


@dataclass
class RevertPlan:
    """What revert will do, decided before anything is changed."""

    actions: list[tuple[str, RevertAction]] = field(default_factory=list)  # (description, what)
    notes: list[str] = field(default_factory=list)  # what is left alone, and why
    problems: list[str] = field(default_factory=list)  # why revert must change nothing
    # modules-cache folders replaced by a symlink since fix: the only problem, when each
    # problem is one of these, and removing the links is all it takes
    links: list[Path] = field(default_factory=list)
    link_problems: int = 0
    users: list[tuple[Path, str]] = field(default_factory=list)  # registry files to remove
    # every file fix changed in the folder is back as it was before fix: what a revert
    # killed after restoring them leaves (or the user's own undoing); the records are stale
    undone: bool = False


def plan_revert(
    data: JournalData, root: Path, identity: FolderIdentity, modules_root: Path
) -> RevertPlan:
    """Check every entry of `data` (the journal of the folder `root`, whose identity is
    `identity`, as read_journal returns it) and decide what revert would do, with this
    environment's modules-cache root `modules_root`. Changes nothing."""
    planner = _Planner(data, Path(root), identity, os.path.abspath(modules_root))
    plan = RevertPlan()
    for rel in sorted(data["files"]):
        planner.entry(plan, planner.root, rel, data["files"][rel], rel)
    planner.planted(plan)
    plan.undone = bool(data["files"]) and all(
        _is_original_at(Path(root), rel, entry) for rel, entry in data["files"].items()
    )
    return plan


def _is_original_at(base: Path, rel: str, entry: Entry) -> bool:
    try:
        return is_original(present_at_path(base, rel.split("/")), entry)
    except OSError:
        return False


class _Planner:
    def __init__(self, data: JournalData, root: Path, identity: FolderIdentity, here: str) -> None:
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
                    start = len(plan.actions)
                    for rel in sorted(rels):
                        self.entry(plan, Path(here), rel, files[rel], str(Path(here) / rel))
                    self._copies(plan, Path(here), folder_rel, rels, start)
                me = folder / USERS_DIRNAME / user_record_name(self.identity["path"])
                for record in {me, *user_records(folder, self.identity, self.root)[0]}:
                    plan.users.append((record, str(folder)))

    def _copies(
        self, plan: RevertPlan, here: Path, folder_rel: str, rels: list[str], start: int
    ) -> None:
        """A modules-cache folder no other prepared folder uses: also what a load copied
        there because of fix (probe/modcopies.py), their bytecode, and on transformers 5.x
        the hash folder once nothing else is left in it."""
        parts = folder_rel.split("/") if folder_rel else []
        folder = here.joinpath(*parts)
        removed = {
            a.parts[-1]
            for _d, a in plan.actions[start:]
            if isinstance(a, Remove) and a.base == here and a.parts[:-1] == parts
        }
        for name in copies(here, parts, {os.path.basename(r) for r in rels}):
            plan.actions.append(
                (
                    f"{folder / name} (removed: the copy a load made of what fix changed)",
                    Remove(here, [*parts, name]),
                )
            )
            removed.add(name)
        cached = bytecode(here, parts, removed)
        pycache = [*parts, PYCACHE]
        for name in cached:
            path = [*pycache, name]
            shown = f"{here.joinpath(*path)} (removed: its bytecode)"
            plan.actions.append((shown, Remove(here, path)))
        gone: set[str] = set()
        if cached and left_empty(here, pycache, set(cached), set()):
            shown = f"{here.joinpath(*pycache)} (removed: empty)"
            plan.actions.append((shown, RemoveDir(here, pycache)))
            gone.add(PYCACHE)
        records = {r for r, _f in plan.users} | {
            folder / USERS_DIRNAME / user_record_name(self.identity["path"]),
            *user_records(folder, self.identity, self.root)[0],
        }
        names = {r.name for r in records if r.parent == folder / USERS_DIRNAME}
        if left_empty(here, [*parts, USERS_DIRNAME], names, set()):
            gone.add(USERS_DIRNAME)
        if (
            removed
            and HASH_FOLDER.fullmatch(folder_rel)
            and left_empty(here, parts, removed, gone)
        ):
            plan.actions.append(
                (f"{folder} (removed: empty, named after the code with fix's lines)",
                 RemoveDir(here, parts))
            )

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
            link = _link_in(base, parts[:-1]) if base != self.root else None
            if link is not None:
                if link not in plan.links:
                    plan.links.append(link)
                plan.link_problems += 1
                plan.problems.append(
                    f"{shown}: {link} is a symbolic link now (to {_target(link)}), and revert "
                    "never follows one"
                )
                return
            plan.problems.append(
                f"{shown}: its folder cannot be reached without following a symlink or "
                f"leaving {base} ({exc.strerror or exc})"
            )
            return
        marked = base == self.root and rel == MODELING_FILE
        try:
            current = present_at(fd, name) if fd >= 0 else Present("absent")
            st = lstat_at(fd, name) if marked and fd >= 0 else None
        except OSError as exc:
            plan.problems.append(f"{shown} cannot be read: {exc.strerror or exc}")
            return
        finally:
            if fd >= 0:
                os.close(fd)
        mode = st.st_mode & 0o777 if st is not None else 0o644
        if marked and self._marked(plan, base, parts, entry, current, shown, mode):
            return
        if is_original(current, entry):
            plan.notes.append(f"{shown}: already as it was before fix")
            return
        if not is_ours(current, entry):
            if self._only_copy(base, name, current, entry):
                original = self._original(plan, entry, shown)
                if original is not None:
                    plan.actions.append(
                        (
                            f"{shown} (put back: gone since fix, and the original fix kept "
                            "is found nowhere else)",
                            Restore(base, parts, *original),
                        )
                    )
                return
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
        original = self._original(plan, entry, shown)
        if original is not None:
            plan.actions.append((shown, Restore(base, parts, *original)))

    def _only_copy(self, base: Path, name: str, current: Present, entry: Entry) -> bool:
        """A modules-cache file gone since fix (its folder removed, or a link to it taken
        away) whose original the journal kept: put back rather than dropped with the
        journal, unless it is what transformers copies from DIR (DIR's own file of that
        name, before fix or now), which the next load makes again."""
        if base == self.root or current.kind != "absent" or entry["kind"] != "file":
            return False
        digest = entry.get("sha256")
        if digest is None:
            return False
        mine = self.data["files"].get(name)
        if mine is not None and mine["kind"] == "file" and mine.get("sha256") == digest:
            return False
        try:
            here = present_at_path(self.root, [name])
        except OSError:
            return True
        return here.digest != digest

    def _marked(
        self,
        plan: RevertPlan,
        base: Path,
        parts: list[str],
        entry: Entry,
        current: Present,
        shown: str,
        mode: int,
    ) -> bool:
        """modeling_qwen.py still holding lines fix added: plan to take out exactly those
        (the original itself when that is what is left). False when it holds none of
        them: the rules of every other file apply."""
        if current.kind != "file" or current.data is None:
            return False
        try:
            text = current.data.decode("utf-8")
        except UnicodeDecodeError:
            return False
        problem = compat.marker_problem(text)
        if problem is not None:
            plan.problems.append(
                f"{shown}, {problem}: revert cannot tell qwen-kvprep's lines from yours; put "
                "the marked lines back as fix wrote them, or delete them with both markers "
                "(keeping your own lines), then run revert again"
            )
            return True
        data = compat.without_ours(text).encode("utf-8")
        if data == current.data:
            return False
        if entry["kind"] == "file":
            original = self._original(plan, entry, shown)
            if original is None:
                return True
            old = original[0]
            # fix's first releases added a line break to a file without a final one; fix
            # writes the file without a UTF-8 BOM it started with (steps/fastkv.py)
            if old.startswith(b"\xef\xbb\xbf"):
                old = old[3:]
            if data == old or (data == old + b"\n" and not old.endswith(b"\n")):
                plan.actions.append((shown, Restore(base, parts, *original)))
                return True
        elif is_ours(current, entry):
            return False  # as fix wrote it over a link: put the link back
        plan.actions.append(
            (
                f"{shown} (changed since fix: qwen-kvprep's marked lines taken out, yours kept)",
                Restore(base, parts, data, mode),
            )
        )
        return True

    def _original(
        self, plan: RevertPlan, entry: Entry, shown: str
    ) -> Optional[tuple[bytes, int]]:
        """The original fix kept for a file entry and the mode to restore it with, its
        sha256 verified; None, with the reason in `plan.problems`, when it cannot be."""
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
            return None
        except NotRegularFile as exc:
            plan.problems.append(f"{shown}: its original {store_path} {exc.strerror}")
            return None
        except OSError as exc:
            plan.problems.append(
                f"{shown}: its original {store_path} cannot be read safely "
                f"({exc.strerror or exc})"
            )
            return None
        digest = entry.get("sha256")
        if digest is not None and sha256(data) != digest:
            plan.problems.append(
                f"{shown}: its original {store_path} changed since fix kept it (sha256 "
                f"{sha256(data)[:16]}…, recorded {digest[:16]}…), so it is not restored"
            )
            return None
        mode = entry.get("mode")  # version 1 kept it on the stored copy instead
        return data, store_mode if mode is None else mode & 0o777


def read_user_records(folder: Path) -> list[tuple[Path, str]]:
    """(record, the prepared folder it names) for each record in a modules-cache folder's
    USERS_DIRNAME, in name order; unreadable records, and records not named after the
    folder they name, are skipped (bounded reads: the folder is shared)."""
    return read_records(Path(folder) / USERS_DIRNAME)


def read_records(users: Path) -> list[tuple[Path, str]]:
    """(record, the prepared folder it names) for each `{"path": DIR}` record in the folder
    `users` (a modules-cache folder's, or the build cache's users/<key>/), as above. A
    records folder that is a symbolic link holds no records of ours: none is read there."""
    if os.path.islink(users):
        return []
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


def user_records(
    folder: Path, identity: FolderIdentity, root: Path
) -> tuple[list[Path], list[str]]:
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
    folder: Path, rel: str, digest: str, identity: FolderIdentity, root: Path, modules_root: Path
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


def _link_in(base: Path, parts: list[str]) -> Optional[Path]:
    """The first folder of `base/parts` (below `base`) that is a symbolic link, or None."""
    here = base
    for part in parts:
        here = here / part
        if os.path.islink(here):
            return here
    return None


def _target(link: Path) -> str:
    try:
        return os.readlink(link)
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
