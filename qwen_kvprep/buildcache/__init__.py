"""The build cache: one compiled extension per ABI, shared by every checkpoint.

Importing this package imports neither torch nor transformers (doctor and prestart read
manifests); planning or compiling a build does.

    layout = CacheLayout(resolve_cache_dir(None))
    plan = plan_build(vendored_sources(), arch=None)
    result = ensure_build(plan, layout)          # found, or compiled under the lock
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Optional, Protocol

from qwen_kvprep.buildcache.lock import DEFAULT_LOCK_TIMEOUT, lock_timeout
from qwen_kvprep.buildcache.manifest import (
    BUILD_LOG,
    EXTENSION_NAME,
    MANIFEST,
    MANIFEST_VERSION,
    list_builds,
    read_manifest,
)
from qwen_kvprep.buildcache.paths import CacheLayout, resolve_cache_dir
from qwen_kvprep.common import ENV_CACHE, ENV_LOCK_TIMEOUT, KERNEL_FILES
from qwen_kvprep.errors import SourceError
from qwen_kvprep.resources import kernels_dir

__all__ = [
    "BUILD_LOG",
    "DEFAULT_LOCK_TIMEOUT",
    "ENV_CACHE",
    "ENV_LOCK_TIMEOUT",
    "EXTENSION_NAME",
    "MANIFEST",
    "MANIFEST_VERSION",
    "CacheLayout",
    "list_builds",
    "lock_timeout",
    "read_manifest",
    "read_sources",
    "resolve_cache_dir",
    "vendored_sources",
]


def read_sources(folder: Path, required: Optional[tuple[str, ...]] = None) -> dict[str, bytes]:
    """The kernel sources found in `folder` (both KERNEL_FILES when present)."""
    out: dict[str, bytes] = {}
    for name in KERNEL_FILES:
        path = Path(folder) / name
        if path.is_file():
            out[name] = path.read_bytes()
    missing = [n for n in (required or ()) if n not in out]
    if missing:
        raise SourceError(
            f"{folder} lacks {', '.join(missing)}",
            fix=f"put the kernel sources into {folder}, or leave out --source-dir to build "
            "qwen-kvprep's own kernels",
        )
    return out


def vendored_sources() -> dict[str, bytes]:
    """qwen-kvprep's own kernels (the default sources)."""
    return read_sources(kernels_dir(), required=KERNEL_FILES)


class ChosenSources(Protocol):
    """What `fix` chose (steps.context.SourceSet): kernel source file name -> bytes."""

    @property
    def files(self) -> Mapping[str, bytes]: ...


def sources_of(chosen: Optional[ChosenSources]) -> Mapping[str, bytes]:
    """The sources `fix` chose (ctx.sources.files), else the vendored ones."""
    if chosen is not None and chosen.files:
        return {name: data for name, data in chosen.files.items() if name in KERNEL_FILES}
    return vendored_sources()
