"""The official-source catalogue: Qwen's own kernel sources, known by their sha256.

The official `.cpp`/`.cu` are under Qwen's license, so the package ships only their sha256
and size (data/official_kernels.json), with the Qwen v1 repos known to carry them. Here a
pair of kernel sources found in some folder is classified (official, qwen-kvprep's own,
modified, missing), and it is decided whether the official pair compiles with a given
torch. Pure reading: nothing is fetched (steps/download.py does that).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep import resources

DATA_FILE = Path(__file__).resolve().parent / "data" / "official_kernels.json"

# What a kernel source file in some folder is, by its hash.
OFFICIAL = "official"  # Qwen's file, byte for byte
OURS = "ours"  # the installed qwen-kvprep's kernels/
MODIFIED = "modified"  # present, but neither of the above
MISSING = "missing"
MIXED = "mixed"  # for a pair whose two files differ in kind


@dataclass(frozen=True)
class KnownFile:
    name: str
    sha256: str
    size: int


@dataclass(frozen=True)
class KnownGood:
    files: Mapping[str, KnownFile]
    repos: tuple[str, ...]  # Qwen v1 repos known to carry the files, for messages


def load_known_good(path: Path = DATA_FILE) -> KnownGood:
    raw = json.loads(path.read_text(encoding="utf-8"))
    files = {
        name: KnownFile(name, entry["sha256"], int(entry["size"]))
        for name, entry in raw["files"].items()
    }
    if set(files) != set(resources.KERNEL_FILES):
        raise RuntimeError(f"{path} must list exactly {resources.KERNEL_FILES}")
    return KnownGood(files, tuple(raw.get("repos", ())))


@functools.cache
def known_good() -> KnownGood:
    """The package's list of official file hashes (tests swap this function out)."""
    return load_known_good()


def ours_hashes() -> Optional[dict[str, str]]:
    """sha256 of the installed package's kernels/, or None when they are not there."""
    try:
        return resources.vendored_kernel_hashes()
    except OSError:
        return None


# -- what a folder holds ------------------------------------------------------------------
def classify_file(name: str, sha256: Optional[str], ours: Optional[Mapping[str, str]]) -> str:
    if sha256 is None:
        return MISSING
    known = known_good().files.get(name)
    if known is not None and sha256 == known.sha256:
        return OFFICIAL
    if ours is not None and ours.get(name) == sha256:
        return OURS
    return MODIFIED


def classify_set(
    hashes: Mapping[str, Optional[str]], ours: Optional[Mapping[str, str]]
) -> tuple[str, dict[str, str]]:
    """Kind of the pair (one of the constants, MIXED when the files differ) and per file."""
    per_file = {
        name: classify_file(name, hashes.get(name), ours) for name in resources.KERNEL_FILES
    }
    kinds = set(per_file.values())
    return (kinds.pop() if len(kinds) == 1 else MIXED), per_file


# -- what the official sources need from torch ----------------------------------------------
@dataclass(frozen=True)
class Compat:
    status: str  # "ok" | "no" | "unknown"
    reason: str


# The official .cu dispatches with AT_DISPATCH_*(tensor.type(), ...). torch accepted the
# deprecated DeprecatedTypeProperties there through an overload of detail::scalar_type()
# that later releases dropped; without it the build stops with "no suitable conversion
# function from const at::DeprecatedTypeProperties to c10::ScalarType" (reproduced with
# 2.11). The boundary comes from reading ATen/Dispatch.h in the PyPI wheels:
# 2.5.1 still has `scalar_type(const at::DeprecatedTypeProperties&)` (a deprecation
# warning, but it compiles); 2.6.0, 2.7.0, 2.9.1, 2.10.0, 2.11.0 and 2.13.0 only have
# `scalar_type(at::ScalarType)`. Pre-releases of 2.6 count as 2.6 (compared on major.minor).
OFFICIAL_MAX_TORCH = (2, 5)


def official_compat(torch_version: Optional[str], torch_cuda: Optional[str]) -> Compat:
    """Can the official sources compile with this torch? `torch_cuda` is torch.version.cuda
    ("" or None for a CPU-only build; pass "?" when it is not known)."""
    if not torch_version:
        return Compat("unknown", "torch is not installed")
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(torch_version).release
    except InvalidVersion:
        return Compat("unknown", f"cannot parse the torch version {torch_version!r}")
    limit = ".".join(map(str, OFFICIAL_MAX_TORCH))
    if release[:2] > OFFICIAL_MAX_TORCH:
        return Compat(
            "no",
            f"torch {torch_version} no longer accepts the deprecated tensor.type() dispatch "
            f"the official .cu uses (torch <= {limit} does)",
        )
    if torch_cuda in (None, ""):
        return Compat(
            "no", f"torch {torch_version} is a CPU-only build; the official sources need CUDA"
        )
    return Compat("ok", f"torch {torch_version} still accepts the official sources' dispatch")
