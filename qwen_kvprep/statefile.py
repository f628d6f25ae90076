"""Reading `<checkpoint>/.qwen-kvprep/state.json` back: a file in a folder anyone with write
access may have changed, read by prestart's fast path on every container start.

`read_state` reads it as untrusted data (a regular file, at most 1 MiB, strict JSON, at
most 16 levels deep) and checks it against its schema; prestart, fix and doctor all use
it, so they agree on what a damaged state is. Standard library only (the fast path).

    {"state_version": 1, "tool_version", "checkpoint": abs path,
     "files": {name: sha256 or null},      config.json, cpp_kernels.py, the kernel sources
     "sources": {...} | null, "packages": {name: version or null},
     "build": {"key", "dir", "so", "cuda", "arch_list"} | null,
     "modules": {"root", "folder", "files": {name: sha256}, "hub_folder"} | null,
     "smoke": {...} | null, "updated": iso time}

In "modules", `folder` and `hub_folder` must lie inside `root` (they are used relative to
it, moved to the modules root of the environment that reads them), and `files` may name
only the kernel sources and the loader.
"""

from __future__ import annotations

import os
import re

from qwen_kvprep.common import MODULE_FILES, STATE_DIRNAME, STATE_FILE, TRACKED_FILES
from qwen_kvprep.untrusted import describe_json_error, read_record, relpath_problem

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

STATE_VERSION = 1
_HEX64 = re.compile(r"[0-9a-f]{64}")


def state_file(target: str) -> str:
    return os.path.join(target, STATE_DIRNAME, STATE_FILE)


def _abs(value: Any) -> bool:
    return isinstance(value, str) and os.path.isabs(value) and "\x00" not in value


def _digest(value: Any) -> bool:
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def inside(root: str, path: str) -> Optional[str]:
    """`path` relative to `root` when it lies inside it (normalised), else None."""
    rel = os.path.relpath(os.path.normpath(path), os.path.normpath(root))
    return rel if rel == "." or relpath_problem(rel) is None else None


def schema_problem(data: Any) -> Optional[str]:
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
    for name, digest in files.items():
        if name not in TRACKED_FILES:
            return f"tracks {name!r}, which is not a file fix changes"
        if digest is not None and not _digest(digest):
            return f"has an invalid sha256 for {name}"
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
        if not isinstance(build.get("so"), str) or "\x00" in build["so"]:
            return "has a build without its library"
        arch = build.get("arch_list")
        if arch is not None and (
            not isinstance(arch, list) or not all(isinstance(a, str) for a in arch)
        ):
            return "has a build with an invalid arch_list"
    modules = data.get("modules")
    if modules is not None:
        if not isinstance(modules, dict):
            return "has modules that are not an object"
        root, folder = modules.get("root"), modules.get("folder")
        if not _abs(root) or not _abs(folder):
            return "has modules without an absolute root and folder"
        if inside(str(root), str(folder)) in (None, "."):
            return f"records the modules folder {folder!r} outside its root {root!r}"
        hub = modules.get("hub_folder")
        if hub is not None and (not _abs(hub) or inside(str(root), str(hub)) in (None, ".")):
            return f"records the modules folder {hub!r} outside its root {root!r}"
        planted = modules.get("files")
        if not isinstance(planted, dict):
            return "has modules without files"
        for name, digest in planted.items():
            if name not in MODULE_FILES:
                return f"plants {name!r}, which is not a file fix plants"
            if not _digest(digest):
                return f"has an invalid sha256 for the planted {name}"
    return None


def read_state(target: str) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(state, None), (None, None) when there is none, or (None, why it is unusable)."""
    path = state_file(target)
    try:
        data = read_record(path)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        return None, f"{path} {describe_json_error(exc)}"
    problem = schema_problem(data)
    if problem is not None:
        return None, f"{path} {problem}"
    return data, None
