"""The OUT folder advice suggests for DIR: beside it (`NAME-qwen2`), except for a Hub cache
snapshot, whose neighbours are other revisions inside the cache (huggingface_hub owns that
tree, and `hf cache delete` would take OUT with it): then in the current folder, or the
home folder when the current one is in the cache itself, named after the repo."""

from __future__ import annotations

import os
from pathlib import Path

_SUFFIX = "-qwen2"


def _in_hub_cache(path: Path) -> int:
    """The index of the `models--ORG--NAME` part of `path` when it lies inside a Hub cache
    repo folder's snapshots/ (-1 otherwise)."""
    parts = path.parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            return i
    return -1


def suggested_out(src: Path) -> Path:
    """Where advice tells convert to write OUT for the checkpoint folder `src`."""
    real = Path(os.path.realpath(src))
    at = _in_hub_cache(real)
    if at < 0:
        return real.parent / (real.name + _SUFFIX)
    name = real.parts[at].split("--")[-1] + _SUFFIX
    here = Path(os.path.realpath(Path.cwd()))
    if any(p.startswith("models--") for p in here.parts):
        here = Path(os.path.expanduser("~"))
    return here / name
