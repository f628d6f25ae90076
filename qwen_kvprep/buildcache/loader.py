"""Render templates/cpp_kernels.py.tmpl: the loader `fix` puts in place of cpp_kernels.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from qwen_kvprep import __version__
from qwen_kvprep.common import (
    KERNEL_FILES,
    LOADER_MARKER,
    fix_command,
    prestart_command,
    sha256_bytes,
)
from qwen_kvprep.resources import templates_dir

LOADER_TEMPLATE = "cpp_kernels.py.tmpl"


def is_loader(text: str) -> bool:
    """Whether a cpp_kernels.py is ours (the marker sits in its first lines)."""
    return any(line.startswith(LOADER_MARKER) for line in text.splitlines()[:5])


def source_hashes(sources: Mapping[str, bytes]) -> dict[str, str]:
    """What a build's manifest records as inputs.sources (and the loader matches)."""
    return {n: sha256_bytes(sources[n]) for n in sorted(sources) if n in KERNEL_FILES}


def render_loader(
    checkpoint: Path,
    cache_dirs: Sequence[Path],
    sources: Mapping[str, str],
    build_key: Optional[str],
    pinned_sha256: Optional[str] = None,
    fast_sha256: Optional[str] = None,
) -> bytes:
    """The loader's text. Values are Python literals (repr), so paths with quotes or
    non-ASCII characters survive. With `pinned_sha256` (a prebuilt library) it loads that
    library from `build_key`'s folder and nothing else; without, only builds qwen-kvprep
    compiled. `fast_sha256` is the fast path's module as fix wrote it in `checkpoint`, which
    the compatibility module supplies to a modules cache that lacks it."""
    text = (templates_dir() / LOADER_TEMPLATE).read_text(encoding="utf-8")
    values = {
        "TOOL_VERSION": __version__,
        "FIX_COMMAND": repr(fix_command(checkpoint)),
        "PRESTART_COMMAND": repr(prestart_command(checkpoint)),
        "FAST_SHA256": repr(fast_sha256),
        "CHECKPOINT": repr(str(checkpoint)),
        "CACHE_DIRS": repr([str(d) for d in cache_dirs]),
        "BUILD_KEY": repr(build_key),
        "PINNED_SHA256": repr(pinned_sha256),
        "SOURCES": repr(dict(sorted(sources.items()))),
    }
    for name, value in values.items():
        text = text.replace("{{" + name + "}}", value)
    if "{{" in text:
        raise ValueError(f"{LOADER_TEMPLATE}: unrendered placeholder left")
    return text.encode("utf-8")
