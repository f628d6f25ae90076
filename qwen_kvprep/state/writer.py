"""`<checkpoint>/.qwen-kvprep/state.json`: what `fix` did and verified.

prestart reads it on every container start to tell, in a few milliseconds, that nothing
changed; so this module must never import torch or transformers (nor anything that does).

    {"state_version": 1, "tool_version", "checkpoint": abs path,
     "files": {rel: sha256 or null},       config.json, cpp_kernels.py, the kernel sources
     "sources": {"origin": "vendored"|"hub"|"checkpoint", "repo_id", "revision"},
     "packages": {"torch": ver, "transformers": ver},   importlib.metadata versions
     "build": {"key", "dir", "so", "cuda", "arch_list", "so_sha256", "so_size",
               "cache_id"} | null,
     "modules": {"root", "folder", "files": {name: sha256}},
     "smoke": {...} | null, "updated": iso time}
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep import __version__
from qwen_kvprep.common import STATE_DIRNAME, STATE_FILE, TRACKED_FILES, sha256_file
from qwen_kvprep.journal.writer import Journal
from qwen_kvprep.state.reader import STATE_VERSION, read_state

if TYPE_CHECKING:
    from qwen_kvprep.jsontypes import JSONObject
    from qwen_kvprep.state.reader import State, StateBuild, StateModules

# Fields that change on every run without meaning anything changed.
_VOLATILE = ("updated",)


def state_path(directory: Path) -> Path:
    return Path(directory) / STATE_DIRNAME / STATE_FILE


def load_state(directory: Path) -> Optional[State]:
    """The recorded state, or None if absent or unusable (damaged, of another version,
    against the schema: state.reader.read_state, as prestart reads it)."""
    return read_state(str(directory))[0]


def state_problem(directory: Path) -> Optional[str]:
    """Why the recorded state cannot be used (None: it can, or there is none)."""
    return read_state(str(directory))[1]


def file_hashes(
    directory: Path, names: tuple[str, ...] = TRACKED_FILES
) -> dict[str, Optional[str]]:
    """sha256 of each tracked file (None when absent); symlinks are followed."""
    out: dict[str, Optional[str]] = {}
    for name in names:
        path = Path(directory) / name
        try:
            out[name] = sha256_file(path)
        except OSError:
            out[name] = None
    return out


def package_versions(
    names: tuple[str, ...] = ("torch", "transformers"),
) -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def new_state(
    directory: Path,
    *,
    sources: Optional[JSONObject] = None,
    build: Optional[StateBuild] = None,
    modules: Optional[StateModules] = None,
    smoke: Optional[JSONObject] = None,
) -> State:
    state: State = {
        "state_version": STATE_VERSION,
        "tool_version": __version__,
        "checkpoint": str(Path(directory).absolute()),
        "files": file_hashes(directory),
        "sources": sources,
        "packages": package_versions(),
        "build": build,
        "modules": modules,
        "smoke": smoke,
    }
    state["updated"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return state


def _lasting(state: State) -> dict[str, object]:
    return {k: v for k, v in state.items() if k not in _VOLATILE}


def same_state(a: Optional[State], b: Optional[State]) -> bool:
    if a is None or b is None:
        return a is b
    return _lasting(a) == _lasting(b)


def save_state(journal: Journal, state: State) -> bool:
    """Record `state` (unless only its timestamp would change). Returns whether written."""
    if same_state(load_state(journal.root), state):
        return False
    journal.record_state_file(STATE_FILE, json.dumps(state, indent=2, sort_keys=True) + "\n")
    return not journal.dry_run


def update_state(journal: Journal, *, smoke: Optional[JSONObject]) -> bool:
    """Record the smoke test's verdict in the recorded state."""
    state = load_state(journal.root)
    if state is None:
        return False
    merged: State = {**state, "smoke": smoke}
    if same_state(state, merged):
        return False
    merged["updated"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return save_state(journal, merged)
