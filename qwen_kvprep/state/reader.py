"""Reading `<checkpoint>/.qwen-kvprep/state.json` back: a file in a folder anyone with write
access may have changed, read by prestart's quick start on every container start.

`read_state` reads it as untrusted data (a regular file, at most 1 MiB, strict JSON, at
most 16 levels deep) and checks it against its schema; prestart, fix and doctor all use
it, so they agree on what a damaged state is. Standard library only (prestart's quick start).

    {"state_version": 1, "tool_version", "checkpoint": abs path,
     "files": {name: sha256 or null},      config.json, cpp_kernels.py, the kernel sources
     "sources": {...} | null, "packages": {name: version or null},
     "build": {"key", "dir", "so", "cuda", "arch_list", "so_sha256", "so_size",
               "cache_id"} | null,
     "modules": {"root", "folder", "files": {name: sha256}, "hub_folder", "also": [folder]}
                | null,
     "smoke": {...} | null, "updated": iso time}

In "modules", `folder`, `hub_folder` and the folders in `also` (where other spellings of
the checkpoint's path run the model code from: `DIR/`, the real path of a symlink) must lie
inside `root` (they are used relative to
it, moved to the modules root of the environment that reads them), and `files` may name
only the kernel sources and the loader.

A state that passed the check is a `State` (with `StateBuild`, `StateModules`). These
TypedDicts exist for the type checker only (typing is not imported at run time here):
import them under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import os
import re
import shlex
import stat

from qwen_kvprep.common import (
    LOCK_FILE,
    MODULE_FILES,
    STATE_DIRNAME,
    STATE_FILE,
    TRACKED_FILES,
)
from qwen_kvprep.untrusted import describe_json_error, kind_of, read_record, relpath_problem

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs milliseconds at import; only mypy needs it
    from collections.abc import Collection
    from typing import Optional, TypedDict, TypeGuard

    from qwen_kvprep.jsontypes import JSON, JSONObject

    # What schema_problem guarantees of a state read back (fix writes every key; the
    # ones in total=False classes may be missing from a state written by hand).

    class _StateBuildKeys(TypedDict):
        key: str  # the build-cache key
        dir: str  # absolute: <cache>/builds/<key>
        so: str  # the library's file name in `dir`

    class StateBuild(_StateBuildKeys, total=False):
        cuda: JSON  # whether it was built with CUDA (not checked)
        arch_list: Optional[list[str]]  # the GPU architectures it was built for
        so_sha256: str  # the library's sha256, as its manifest records it
        so_size: int  # and its size: a stat at every start tells a damaged library
        cache_id: str  # the build cache's marker id (buildcache/marker.py)

    class _StateModulesKeys(TypedDict):
        root: str  # absolute: the modules-cache root fix planted into
        folder: str  # absolute, inside root: the folder a load by path uses
        files: dict[str, str]  # planted file name (a kernel source, the loader) -> sha256

    class StateModules(_StateModulesKeys, total=False):
        hub_folder: Optional[str]  # absolute, inside root: the folder a load by repo id uses
        also: list[str]  # absolute, inside root (may be root/transformers_modules itself):
        # the folders other spellings of the path use (modcache.spelling_folders)

    class _StateKeys(TypedDict):
        state_version: int
        tool_version: str
        checkpoint: str  # absolute
        files: dict[str, Optional[str]]  # tracked file name -> sha256 (None: absent)
        packages: dict[str, Optional[str]]  # distribution -> version (None: not installed)

    class State(_StateKeys, total=False):
        sources: Optional[JSONObject]  # {"origin", "repo_id", "revision"} (not checked)
        build: Optional[StateBuild]
        modules: Optional[StateModules]
        smoke: Optional[JSONObject]  # the smoke test's verdict (not checked)
        updated: JSON  # ISO time of the last write (not checked)

STATE_VERSION = 1
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")


def state_file(target: str) -> str:
    return os.path.join(target, STATE_DIRNAME, STATE_FILE)


def _abs(value: object) -> bool:
    return isinstance(value, str) and os.path.isabs(value) and "\x00" not in value


def _digest(value: object) -> bool:
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def inside(root: str, path: str) -> Optional[str]:
    """`path` relative to `root` when it lies inside it (normalised), else None."""
    rel = os.path.relpath(os.path.normpath(path), os.path.normpath(root))
    return rel if rel == "." or relpath_problem(rel) is None else None


def schema_problem(data: JSON) -> Optional[str]:
    """Why `data` is not a state this version of qwen-kvprep wrote (None: it is)."""
    if not isinstance(data, dict):
        return "is not a JSON object"
    if data.get("state_version") != STATE_VERSION:
        return f"has state_version {data.get('state_version')!r}, not {STATE_VERSION}"
    if not isinstance(data.get("tool_version"), str):
        return "has no tool_version"
    if not _abs(data.get("checkpoint")):
        return "has no absolute checkpoint path"
    files = data.get("files")
    if not isinstance(files, dict):
        return "has no files table"
    problem = _digests_problem(files, TRACKED_FILES, "tracks", "changes", "", absent_ok=True)
    if problem:
        return problem
    for key in ("sources", "smoke"):
        if data.get(key) is not None and not isinstance(data.get(key), dict):
            return f"has a {key} that is not an object"
    packages = data.get("packages")
    if not isinstance(packages, dict) or not all(
        isinstance(v, (str, type(None))) for v in packages.values()
    ):
        return "has no valid package versions"
    build = data.get("build")
    if build is not None:
        if not isinstance(build, dict):
            return "has a build that is not an object"
        if not isinstance(build.get("key"), str) or not _abs(build.get("dir")):
            return "has a build without a key and an absolute folder"
        so = build.get("so")
        if not isinstance(so, str) or "\x00" in so:
            return "has a build without its library"
        arch = build.get("arch_list")
        if arch is not None and (
            not isinstance(arch, list) or not all(isinstance(a, str) for a in arch)
        ):
            return "has a build with an invalid arch_list"
        digest, size = build.get("so_sha256"), build.get("so_size")
        if digest is not None and not (isinstance(digest, str) and _HEX64.fullmatch(digest)):
            return "has a build with an invalid so_sha256"
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            return "has a build with an invalid so_size"
        cache_id = build.get("cache_id")
        if cache_id is not None and not (isinstance(cache_id, str) and _HEX32.fullmatch(cache_id)):
            return "has a build with an invalid cache_id"
    modules = data.get("modules")
    if modules is not None:
        if not isinstance(modules, dict):
            return "has modules that are not an object"
        root, folder = modules.get("root"), modules.get("folder")
        if not _abs(root) or not _abs(folder):
            return "has modules without an absolute root and folder"
        hub = modules.get("hub_folder")
        for one in (folder,) if hub is None else (folder, hub):
            if not _inside_root(root, one):
                return f"records the modules folder {one!r} outside its root {root!r}"
        also = modules.get("also", [])
        if not isinstance(also, list):
            return "has modules whose also is not a list"
        for other in also:
            if not _inside_root(root, other):
                return f"records the modules folder {other!r} outside its root {root!r}"
        planted = modules.get("files")
        if not isinstance(planted, dict):
            return "has modules without files"
        return _digests_problem(planted, MODULE_FILES, "plants", "plants", "the planted ")
    return None


def _inside_root(root: object, folder: object) -> bool:
    """Whether `folder` is an absolute path strictly below `root` (root itself is not)."""
    return _abs(folder) and inside(str(root), str(folder)) not in (None, ".")


def _digests_problem(
    table: dict[str, JSON], known: Collection[str], verb: str, does: str, what: str,
    absent_ok: bool = False,
) -> Optional[str]:
    """Why a name -> sha256 table is not one fix wrote: a name fix never `does`, or a digest
    that is not 64 hex digits (None allowed where `absent_ok`: a file fix found absent)."""
    for name, digest in table.items():
        if name not in known:
            return f"{verb} {name!r}, which is not a file fix {does}"
        if not (absent_ok and digest is None) and not _digest(digest):
            return f"has an invalid sha256 for {what}{name}"
    return None


def _is_state(data: JSON, problem: Optional[str]) -> TypeGuard[State]:
    """Whether `data` is a State, `problem` being what schema_problem said of it."""
    return problem is None


def foreign_item(target: str) -> Optional[tuple[str, str, str]]:
    """(path, what is there, what qwen-kvprep keeps there) when DIR/.qwen-kvprep or its lock
    is not what qwen-kvprep made (a link, a FIFO...): state read through a link is someone
    else's, and every write there would land where it points (fix, revert and prestart
    refuse to write through it)."""
    folder = os.path.join(target, STATE_DIRNAME)
    for path, want in ((folder, stat.S_ISDIR), (os.path.join(folder, LOCK_FILE), stat.S_ISREG)):
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if not want(mode):
            return path, kind_of(mode), "folder" if path == folder else "lock file"
    return None


def removal_command(found: tuple[str, str, str]) -> str:
    """The shell command that removes what foreign_item found (a link itself, not its
    target)."""
    path, kind, _ = found
    return f"rm {'-r ' if kind == 'a folder' else ''}{shlex.quote(path)}"


def own_folder_problem(target: str) -> Optional[str]:
    """Why DIR/.qwen-kvprep or its lock is not what qwen-kvprep made, or None."""
    found = foreign_item(target)
    if found is None:
        return None
    path, kind, what = found
    return f"{path} is {kind}, not the {what} qwen-kvprep made"


def read_state(target: str) -> tuple[Optional[State], Optional[str]]:
    """(state, None), (None, None) when there is none, or (None, why it is unusable)."""
    problem = own_folder_problem(target)
    if problem is not None:
        return None, problem
    path = state_file(target)
    try:
        data = read_record(path)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        return None, f"{path} {describe_json_error(exc)}"
    problem = schema_problem(data)
    if not _is_state(data, problem):
        return None, f"{path} {problem}"
    return data, None
