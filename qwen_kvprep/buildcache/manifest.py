"""manifest.json of a published build: its ABI inputs, the extension and its hash.

Read by doctor and prestart too, so this module imports neither torch nor transformers.
A manifest read back is checked against the types below before anything uses it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional, TypedDict

from qwen_kvprep.common import sha256_file
from qwen_kvprep.untrusted import read_record

_ARCH = re.compile(r"[0-9]{1,2}\.[0-9][af]?(\+PTX)?")

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeGuard

    from qwen_kvprep.jsontypes import JSON

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
BUILD_LOG = "build.log"
EXTENSION_NAME = "cache_autogptq_cuda_256"


class BuildFlags(TypedDict, total=False):
    """The compiler flags of a build. A plan always has all three; a manifest read back
    is only required to hold well-typed ones (nothing reads them from a manifest)."""

    cflags: list[str]
    cuda_cflags: list[str]
    with_cuda: bool


class BuildInputs(TypedDict):
    """Every input that makes a build binary-incompatible; the build key is their hash."""

    sources: dict[str, str]  # kernel source file name -> sha256
    flags: BuildFlags
    torch: str  # torch.__version__, "+cu130" tag included
    torch_cuda: Optional[str]  # torch.version.cuda; None for a CPU build of torch
    cxx11_abi: bool
    python_tag: str  # "cp311"
    machine: str  # platform.machine()
    arch_list: list[str]  # the GPU architectures compiled for ("8.0", "9.0+PTX")
    nvcc: Optional[str]  # nvcc's version; None for a CPU-only build
    tool_version: str  # qwen-kvprep's version


class BuilderInfo(TypedDict):
    pid: int
    host: str
    jobs: int


class _ManifestKeys(TypedDict):
    manifest_version: int
    key: str
    inputs: BuildInputs
    cuda: bool
    so: str  # the extension's file name in the build folder
    so_sha256: str


class Manifest(_ManifestKeys, total=False):
    """What a build publishes; the keys of this class are written by every build but
    not required of a manifest read back."""

    build_seconds: float
    created: str  # ISO time, UTC
    covers: list[str]  # nvcc's architectures the arch list runs on
    mode: str  # the plan's sentence: what kind of build and why
    builder: BuilderInfo
    # Who made the library (see ORIGINS): a build serves only what asked for its origin.
    origin: str
    # For a prebuilt one: the SOURCE it was installed from, and the key of the ABI inputs
    # its variant was built for (its own key also covers the library's sha256).
    source: str
    abi_key: str


# `origin` of a build: compiled here by qwen-kvprep from verified sources, or a prebuilt
# variant installed by `fix --prebuilt` (a library someone else compiled). A manifest
# without it predates the distinction and serves nobody: it is compiled again.
COMPILED = "compiled"
PREBUILT = "prebuilt"
ORIGINS = (COMPILED, PREBUILT)


# The keys every manifest carries (extra ones are allowed and ignored by readers).
REQUIRED = ("manifest_version", "key", "inputs", "cuda", "so", "so_sha256")
INPUT_KEYS = (
    "sources",
    "flags",
    "torch",
    "torch_cuda",
    "cxx11_abi",
    "python_tag",
    "machine",
    "arch_list",
    "nvcc",
    "tool_version",
)


def _strings(value: JSON) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _arch_entries(value: JSON) -> bool:
    """A list of architectures as builds record them ("8.0", "9.0a", "9.0+PTX"): what the
    GPU-coverage checks parse, so that an edited one is refused, not a crash there."""
    return isinstance(value, list) and all(
        isinstance(v, str) and _ARCH.fullmatch(v) is not None for v in value
    )


def _str_or_none(value: JSON) -> bool:
    return value is None or isinstance(value, str)


def _number(value: JSON) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _valid_inputs(inputs: JSON) -> bool:
    if not isinstance(inputs, dict) or any(k not in inputs for k in INPUT_KEYS):
        return False
    sources, flags = inputs["sources"], inputs["flags"]
    return (
        isinstance(sources, dict)
        and all(isinstance(v, str) for v in sources.values())
        and isinstance(flags, dict)
        and all(_strings(flags[k]) for k in ("cflags", "cuda_cflags") if k in flags)
        and isinstance(flags.get("with_cuda", False), bool)
        and all(isinstance(inputs[k], str) for k in ("torch", "python_tag", "machine"))
        and isinstance(inputs["tool_version"], str)
        and _str_or_none(inputs["torch_cuda"])
        and _str_or_none(inputs["nvcc"])
        and isinstance(inputs["cxx11_abi"], bool)
        and _arch_entries(inputs["arch_list"])
    )


def _valid_builder(builder: JSON) -> bool:
    return (
        isinstance(builder, dict)
        and isinstance(builder.get("pid"), int)
        and isinstance(builder.get("host"), str)
        and isinstance(builder.get("jobs"), int)
    )


def _is_manifest(data: JSON) -> TypeGuard[Manifest]:
    """Whether `data` is a manifest this version of qwen-kvprep can use."""
    if not isinstance(data, dict) or data.get("manifest_version") != MANIFEST_VERSION:
        return False
    if any(k not in data for k in REQUIRED) or not _valid_inputs(data["inputs"]):
        return False
    if not all(isinstance(data[k], str) for k in ("key", "so", "so_sha256")):
        return False
    if not _plain_name(data["so"]):
        return False  # the extension lies in its build's own folder, by a plain name
    optional: dict[str, Callable[[JSON], bool]] = {
        "build_seconds": _number,
        "created": _is_str,
        "covers": _arch_entries,
        "mode": _is_str,
        "builder": _valid_builder,
        "origin": lambda v: v in ORIGINS,
        "source": _is_str,
        "abi_key": _is_str,
    }
    return isinstance(data["cuda"], bool) and all(
        check(data[k]) for k, check in optional.items() if k in data
    )


def _is_str(value: JSON) -> bool:
    return isinstance(value, str)


def _plain_name(name: JSON) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and not {"/", "\x00"} & set(name)


def parse_manifest(data: JSON) -> Optional[Manifest]:
    """`data` as a manifest when it is one this version can use (a prebuilt variant's
    metadata carries one), else None."""
    return data if _is_manifest(data) else None


def read_manifest(build_dir: Path) -> Optional[Manifest]:
    """The parsed manifest, or None if it is missing, unreadable or not ours."""
    try:
        # a regular file of bounded size: a FIFO or a huge file in a shared cache must not
        # hang or exhaust the reader
        data = read_record(Path(build_dir) / MANIFEST)
    except (OSError, ValueError):
        return None
    return data if _is_manifest(data) else None


def problem(build_dir: Path, manifest: Manifest, check_hash: bool = True) -> Optional[str]:
    """Why this published build cannot be used, or None if it can."""
    so = Path(build_dir) / manifest["so"]
    if not so.is_file() or so.is_symlink():
        return f"{so} is missing (or not a regular file of the build's own)"
    if check_hash and sha256_file(so) != manifest["so_sha256"]:
        return f"{so} does not match the sha256 in its manifest (modified or truncated)"
    return None


def list_builds(builds_root: Path) -> list[tuple[Path, Manifest]]:
    """Every readable published build, newest first."""
    out: list[tuple[Path, Manifest]] = []
    try:
        entries = list(Path(builds_root).iterdir())
    except OSError:
        return out
    for entry in entries:
        manifest = read_manifest(entry)
        if manifest is not None:
            out.append((entry, manifest))
    out.sort(key=lambda item: str(item[1].get("created", "")), reverse=True)
    return out


def dumps(manifest: Manifest) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"
