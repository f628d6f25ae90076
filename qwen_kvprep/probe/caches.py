"""Probe the caches: qwen-kvprep's build cache, transformers' modules cache, the
checkpoint's module folder in it, and torch JIT lock files left in that cache.

Reads only: writability is judged with os.access/statvfs, never by writing, so doctor
also works (and says what would fail) on a read-only file system. The checkpoint's
modules-cache folders are named by the running transformers' own helpers
(probe/codefolders.py: `<name>/<hash>/` on transformers 5), or, when transformers cannot be
imported, as transformers 4.32 to 4.53 name them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Optional, TypedDict

from qwen_kvprep.common import (
    JOURNAL_FILE,
    KERNEL_FILES,
    LOADER_MARKER,
    MODULE_FILES,
    STATE_DIRNAME,
    STATE_FILE,
    TRACKED_FILES,
    USERS_DIRNAME,
    build_cache_root,
    machine,
    modules_cache_root,
    python_tag,
    sha256_file,
)
from qwen_kvprep.common import LOADER_FILE as LOADER
from qwen_kvprep.errors import KvprepError
from qwen_kvprep.fsutil import TEMP_NAME, leftover_temps
from qwen_kvprep.journal.reader import folder_identity, read_journal
from qwen_kvprep.probe.binary import BinaryArchs, read_archs
from qwen_kvprep.probe.codefolders import REAL as REAL_SPELLING
from qwen_kvprep.probe.codefolders import SLASH as SLASH_SPELLING
from qwen_kvprep.probe.codefolders import (
    dynamic_module_utils,
    hub_folder,
    local_folder,
    spelling_folders,
)
from qwen_kvprep.probe.planned import PlannedFile, planned_files
from qwen_kvprep.probe.revertplan import plan_revert, prepared
from qwen_kvprep.state.reader import foreign_item, read_state, removal_command
from qwen_kvprep.untrusted import read_record, read_regular

if TYPE_CHECKING:
    from qwen_kvprep.jsontypes import JSON
    from qwen_kvprep.probe.env import EnvFacts
    from qwen_kvprep.state.reader import State

MODELING = "modeling_qwen.py"
# The official cpp_kernels.py builds into <its folder>/build with torch's FileBaton, whose
# `lock` file stays behind when the build is killed.
JIT_BUILD_DIR = "build"
JIT_LOCK = "lock"
# transformers_modules/<name>/build/lock, or .../<org>/<repo>/<commit>/build/lock.
_LOCK_SEARCH_DEPTH = 6
_HUB_SNAPSHOT = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/([^/]+)/?$")


@dataclass(frozen=True)
class FolderAccess:
    """Whether a cache folder can be written (or created), judged without writing."""

    path: str
    source: str  # how the path was chosen: "--cache-dir", "QWEN_KVPREP_CACHE", ...
    exists: bool = False
    writable: bool = False  # exists and writable, or can be created
    blocker: Optional[str] = None  # the existing path that stops writing
    reason: Optional[str] = None  # why it cannot be written


@dataclass(frozen=True)
class BuildRecord:
    """A published build in <cache>/builds/<key>/."""

    dir: str
    key: str
    manifest: Mapping[str, JSON] = field(default_factory=dict)
    so_path: Optional[str] = None
    so_exists: bool = False
    archs: Optional[BinaryArchs] = None  # None: CPU build, not read

    @property
    def cuda(self) -> bool:
        return bool(self.manifest.get("cuda"))

    def input(self, name: str) -> JSON:
        inputs = self.manifest.get("inputs")
        return inputs.get(name) if isinstance(inputs, Mapping) else None


@dataclass(frozen=True)
class ModuleFolder:
    """A transformers_modules/<name> folder the model code runs from."""

    path: str
    how: str  # LOCAL | HUB | SLASH_SPELLING | REAL_SPELLING
    exists: bool = False
    files: Mapping[str, Optional[str]] = field(default_factory=dict)  # name -> sha256 or None
    loader_is_ours: Optional[bool] = None  # None: no cpp_kernels.py there
    jit_builds: tuple[BinaryArchs, ...] = ()  # extensions the original loader built there


@dataclass(frozen=True)
class LockFile:
    path: str
    age_s: Optional[float] = None
    holders: tuple[tuple[int, str], ...] = ()  # (pid, command line) with the file open
    unreadable: int = 0  # processes whose open files could not be inspected


@dataclass(frozen=True)
class CacheFacts:
    build_cache: Optional[FolderAccess] = None
    builds: tuple[BuildRecord, ...] = ()
    modules_root: Optional[FolderAccess] = None
    module_folders: tuple[ModuleFolder, ...] = ()  # for the checkpoint, if one was given
    locks: tuple[LockFile, ...] = ()
    locks_scanned: bool = False
    state: Optional[State] = None  # <checkpoint>/.qwen-kvprep/state.json
    state_error: Optional[str] = None
    # the command that removes a link (FIFO...) in place of .qwen-kvprep or its lock
    state_foreign_removal: Optional[str] = None
    state_dir: Optional[str] = None  # <checkpoint>/.qwen-kvprep, when given a checkpoint
    journal_present: bool = False
    journal_error: Optional[str] = None  # why the journal cannot be read
    revert_problems: tuple[str, ...] = ()  # why revert would refuse (checked read-only)
    revert_notes: tuple[str, ...] = ()  # what revert would leave alone
    # the journal's every file is back as it was before fix: a revert cut short
    revert_undone: bool = False
    # what the journal says fix wrote (or was about to write) in the checkpoint and in the
    # modules cache, and what is there now (probe/planned.py)
    planned_files: tuple[PlannedFile, ...] = ()
    debris: tuple[str, ...] = ()  # what killed commands of ours left (probe.caches.debris)
    python_tag: str = ""
    machine: str = ""

    @property
    def module_folder(self) -> Optional[ModuleFolder]:
        """The folder a server loading the checkpoint by path uses (the first candidate)."""
        return self.module_folders[0] if self.module_folders else None

    @property
    def module_kernel_sources(self) -> Optional[dict[str, Optional[str]]]:
        """sha256 of the kernel sources beside the modules-cache copy of the model code,
        None when that folder does not exist yet (read by checks/kernels.py)."""
        mf = self.module_folder
        if mf is None or not mf.exists:
            return None
        return {n: mf.files.get(n) for n in KERNEL_FILES}


# ---------------------------------------------------------------------------------------


def _read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def folder_access(path: Path, source: str) -> FolderAccess:
    p = Path(path)
    try:
        if p.exists():
            if not p.is_dir():
                return FolderAccess(
                    str(p), source, True, False, str(p), "it is a file, not a folder"
                )
            ok = os.access(p, os.W_OK | os.X_OK)
            return FolderAccess(
                str(p), source, True, ok, None if ok else str(p), None if ok else _why(str(p))
            )
        anc = p.parent
        while not anc.exists() and anc != anc.parent:
            anc = anc.parent
        if not anc.is_dir():
            return FolderAccess(
                str(p), source, False, False, str(anc), f"{anc} is a file, not a folder"
            )
        ok = os.access(anc, os.W_OK | os.X_OK)
        return FolderAccess(
            str(p),
            source,
            False,
            ok,
            None if ok else str(anc),
            None if ok else f"cannot be created: {_why(str(anc))}",
        )
    except OSError as exc:
        return FolderAccess(str(p), source, False, False, str(p), exc.strerror or str(exc))


def _why(path: str) -> str:
    if _read_only_fs(path):
        return f"{path} is on a read-only file system"
    return f"{path} is not writable by this user"


def build_cache_dir(option: Optional[Path], environ: Mapping[str, str]) -> tuple[Path, str]:
    """The build cache (common.build_cache_root), with what chose it."""
    path, source = build_cache_root(option, environ)
    return Path(path), source


def module_folder_candidates(
    directory: Path, root: Path, dmu: Optional[ModuleType] = None
) -> list[tuple[Path, str]]:
    """The modules-cache folders a load of the checkpoint runs its code from: by its path
    first, by repo id for a huggingface_hub snapshot (<org>/<repo>/<commit>), then by the
    other spellings of its path. `dmu`: the running transformers' dynamic_module_utils,
    whose own naming gives the folders (transformers 5: `<name>/<hash>/`); without it, the
    folders transformers 4.32 to 4.53 use."""
    m = _HUB_SNAPSHOT.search(str(directory))
    if dmu is not None:
        out = [(local_folder(dmu, root, directory), LOCAL)]
        if m:
            repo_id = f"{m.group(1)}/{m.group(2)}"
            out.append((hub_folder(dmu, root, repo_id, m.group(3)), HUB))
        return out + spelling_folders(dmu, root, directory)
    base = root / "transformers_modules"
    out = [(base / Path(str(directory).rstrip("/")).name, LOCAL)]
    if m:
        out.append((base / m.group(1) / m.group(2) / m.group(3), HUB))
    # transformers names the folder after the path as spelt (docs/qwen-v1.md): `DIR/` and
    # `DIR/.` run the code from transformers_modules/ itself, a symlink's real path from
    # the real folder's name (spelling_folders, which fix plants into)
    out.append((base, SLASH_SPELLING))
    real = os.path.basename(os.path.realpath(directory))
    if real != Path(str(directory).rstrip("/")).name:
        out.append((base / real, REAL_SPELLING))
    return out


LOCAL = "local path"
HUB = "hub repo id"


def debris(
    directory: Path, folders: Sequence[Path], spellings: Sequence[str] = ()
) -> tuple[str, ...]:
    """What killed commands of ours left: temporary files in the checkpoint, its
    `.qwen-kvprep/` and the modules-cache folders (and their users' records), and records
    of prepared folders that are no longer prepared. `spellings` are other paths of this
    very folder (the one its state was recorded through: a bind mount, a container's
    path): a record of one of them is this folder's own, in use, even where that path does
    not exist."""
    found: list[str] = []
    state = Path(directory) / STATE_DIRNAME
    ours = set(TRACKED_FILES)
    found += [
        str(Path(directory) / n)
        for n in leftover_temps(directory)
        if (m := TEMP_NAME.match(n)) and m.group(1) in ours
    ]
    for folder in (state, state / "originals"):
        found += [str(folder / n) for n in leftover_temps(folder)]
    for folder in folders:
        users = folder / USERS_DIRNAME
        found += [str(folder / n) for n in leftover_temps(folder)]
        found += [str(users / n) for n in leftover_temps(users)]
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(users)):
                try:
                    data = json.loads(read_regular(users / name, 4096, follow=False))
                except (OSError, ValueError):
                    continue
                path = data.get("path") if isinstance(data, dict) else None
                if isinstance(path, str) and path not in spellings and not prepared(path):
                    found.append(str(users / name))
    return tuple(found)


def _probe_module_folder(path: Path, how: str) -> ModuleFolder:
    if not path.is_dir():
        return ModuleFolder(str(path), how, False)
    files: dict[str, Optional[str]] = {}
    for name in (*MODULE_FILES, MODELING):
        try:
            files[name] = sha256_file(path / name) if (path / name).is_file() else None
        except OSError:
            files[name] = None
    ours: Optional[bool] = None
    if files.get(LOADER):
        try:
            with open(path / LOADER, encoding="utf-8", errors="replace") as fh:
                head = "".join(fh.readline() for _ in range(10))
            ours = LOADER_MARKER in head
        except OSError:
            ours = None
    jit: list[BinaryArchs] = []
    with contextlib.suppress(OSError):
        jit = [read_archs(so) for so in sorted((path / JIT_BUILD_DIR).glob("*.so"))]
    return ModuleFolder(str(path), how, True, files, ours, tuple(jit))


def _read_builds(cache: Path) -> tuple[BuildRecord, ...]:
    builds_root = cache / "builds"
    try:
        entries = sorted(p for p in builds_root.iterdir() if p.is_dir())
    except OSError:
        return ()
    out = []
    for entry in entries:
        try:
            manifest = read_record(entry / "manifest.json")
        except (OSError, ValueError):
            continue
        if not isinstance(manifest, dict):
            continue
        so_name = manifest.get("so")
        so = entry / str(so_name) if isinstance(so_name, str) and so_name else None
        so_exists = so is not None and so.is_file()
        archs = read_archs(so) if so is not None and so_exists and manifest.get("cuda") else None
        out.append(
            BuildRecord(
                str(entry),
                str(manifest.get("key", entry.name)),
                manifest,
                str(so) if so else None,
                so_exists,
                archs,
            )
        )
    return tuple(out)


def _read_state(directory: Path) -> tuple[Optional[State], Optional[str]]:
    """The recorded state, read as prestart and fix read it (size, depth, schema)."""
    try:
        return read_state(str(directory))
    except Exception as exc:  # never abort doctor over what a folder holds
        path = directory / STATE_DIRNAME / STATE_FILE
        return None, f"{path} cannot be read: {type(exc).__name__}: {exc}"


class _JournalFacts(TypedDict, total=False):
    """The CacheFacts _read_journal finds (those it leaves out keep their defaults)."""

    state_dir: str
    journal_present: bool
    journal_error: str
    revert_problems: tuple[str, ...]
    revert_notes: tuple[str, ...]
    revert_undone: bool
    planned_files: tuple[PlannedFile, ...]


def _read_journal(directory: Path, modules_root: Path) -> _JournalFacts:
    """Whether DIR has a journal, whether it is sound, whether revert would succeed
    (revert's own checks, run read-only), and what fix wrote or was about to write."""
    out: _JournalFacts = {"state_dir": str(directory / STATE_DIRNAME)}
    out["journal_present"] = os.path.lexists(directory / STATE_DIRNAME / JOURNAL_FILE)
    if not out["journal_present"]:
        return out
    try:
        journal = read_journal(directory, modules_root)
        plan = plan_revert(journal, directory, folder_identity(directory), modules_root)
    except KvprepError as exc:
        out["journal_error"] = exc.message
        return out
    except Exception as exc:  # never abort doctor over what a folder holds
        out["journal_error"] = f"the journal cannot be read: {type(exc).__name__}: {exc}"
        return out
    out["revert_problems"] = tuple(plan.problems)
    out["revert_notes"] = tuple(plan.notes)
    out["revert_undone"] = plan.undone
    out["planned_files"] = planned_files(journal, directory)
    return out


# ---------------------------------------------------------------------------------------
# torch JIT lock files and who holds them


def find_jit_locks(root: Path) -> list[Path]:
    """`build/lock` files anywhere below the modules cache (bounded depth)."""
    base = root / "transformers_modules"
    found: list[Path] = []
    if not base.is_dir():
        return found
    base_depth = len(base.parts)
    for dirpath, dirnames, filenames in os.walk(base):
        here = Path(dirpath)
        if here.name == JIT_BUILD_DIR and JIT_LOCK in filenames:
            found.append(here / JIT_LOCK)
        if len(here.parts) - base_depth >= _LOCK_SEARCH_DEPTH:
            dirnames[:] = []
        else:
            # Never descend into __pycache__ or the object files of a build.
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
    return sorted(found)


def open_file_holders(
    paths: list[Path], proc: Path = Path("/proc")
) -> tuple[dict[str, list[tuple[int, str]]], int]:
    """Which processes hold each path open (torch's FileBaton keeps the lock's descriptor
    open for the whole build), and how many processes could not be inspected."""
    wanted = {os.path.realpath(p): str(p) for p in paths}
    holders: dict[str, list[tuple[int, str]]] = {str(p): [] for p in paths}
    unreadable = 0
    me = os.getpid()
    try:
        pids = [int(e) for e in os.listdir(proc) if e.isdigit()]
    except OSError:
        return holders, -1
    for pid in pids:
        if pid == me:
            continue
        fd_dir = proc / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            continue  # exited meanwhile
        except OSError:
            unreadable += 1
            continue
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target in wanted:
                holders[wanted[target]].append((pid, _cmdline(proc, pid)))
    return holders, unreadable


def _cmdline(proc: Path, pid: int) -> str:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200] or "?"


def _locks(root: Path) -> tuple[LockFile, ...]:
    paths = find_jit_locks(root)
    if not paths:
        return ()
    holders, unreadable = open_file_holders(paths)
    now = time.time()
    out = []
    for p in paths:
        try:
            age: Optional[float] = max(0.0, now - p.stat().st_mtime)
        except OSError:
            age = None
        out.append(LockFile(str(p), age, tuple(holders.get(str(p), ())), unreadable))
    return tuple(out)


# ---------------------------------------------------------------------------------------


def probe_caches(
    directory: Optional[Path],
    env: Optional[EnvFacts] = None,
    cache_dir: Optional[Path] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> CacheFacts:
    """Gather CacheFacts. Never raises, never writes. `env` (EnvFacts) is accepted for the
    shared probe signature; nothing here depends on it."""
    del env
    environ = os.environ if environ is None else environ
    tag, mach = python_tag(), machine()
    cache, cache_source = build_cache_dir(cache_dir, environ)
    root_text, root_source = modules_cache_root(environ)
    root = Path(root_text)
    folders: tuple[ModuleFolder, ...] = ()
    state: Optional[State] = None
    state_error: Optional[str] = None
    foreign: Optional[str] = None
    journal: _JournalFacts = {}
    left: tuple[str, ...] = ()
    if directory is not None:
        candidates = module_folder_candidates(directory, root, dynamic_module_utils())
        folders = tuple(_probe_module_folder(p, how) for p, how in candidates)
        state, state_error = _read_state(Path(directory))
        found = foreign_item(str(directory))
        foreign = removal_command(found) if found is not None else None
        journal = _read_journal(Path(directory), root)
        # the folders the model code runs from, and those fix planted into (revert cleans them)
        wrote = journal.get("planned_files", ())
        planted = [p.folder for p in wrote if p.folder and os.path.isdir(p.folder)]
        used = [mf.path for mf in folders if mf.exists] + planted
        recorded = state.get("checkpoint") if state is not None else None
        left = debris(
            Path(directory), [Path(f) for f in dict.fromkeys(used)],
            [recorded] if isinstance(recorded, str) else [],
        )
    return CacheFacts(
        build_cache=folder_access(cache, cache_source),
        builds=_read_builds(cache),
        modules_root=folder_access(root, root_source),
        module_folders=folders,
        locks=_locks(root),
        locks_scanned=True,
        state=state,
        state_error=state_error,
        state_foreign_removal=foreign,
        **journal,
        debris=left,
        python_tag=tag,
        machine=mach,
    )


def usable_builds(caches: Optional[CacheFacts], env: Optional[EnvFacts]) -> list[BuildRecord]:
    """Published builds whose ABI inputs fit the running torch and Python, the one fix
    recorded in the checkpoint's state first. (The loader matches the full key; the nvcc
    version and arch list are not known without running nvcc, so this is the ABI part.)"""
    if caches is None or env is None or getattr(env, "torch_version", None) is None:
        return []
    out = []
    for b in caches.builds:
        if not b.so_exists or b.input("torch") != env.torch_version:
            continue
        abi = b.input("cxx11_abi")
        if abi is not None and env.cxx11_abi is not None and bool(abi) != bool(env.cxx11_abi):
            continue
        if caches.python_tag and b.input("python_tag") not in (None, caches.python_tag):
            continue
        if caches.machine and b.input("machine") not in (None, caches.machine):
            continue
        out.append(b)
    build = caches.state.get("build") if isinstance(caches.state, Mapping) else None
    key = build.get("key") if isinstance(build, Mapping) else None
    out.sort(key=lambda b: (b.key != key, not b.cuda))
    return out


def serving_builds(
    caches: Optional[CacheFacts],
    env: Optional[EnvFacts],
    sources: Optional[Mapping[str, Optional[str]]] = None,
) -> list[BuildRecord]:
    """usable_builds of these kernel sources (name -> sha256), the ones a checkpoint's
    loader matches; all usable builds when the pair is not known."""
    builds = usable_builds(caches, env)
    wanted = {n: (sources or {}).get(n) for n in KERNEL_FILES}
    if not all(wanted.values()):
        return builds
    return [b for b in builds if b.input("sources") in (None, wanted)]
