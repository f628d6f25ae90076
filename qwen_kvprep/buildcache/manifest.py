"""manifest.json of a published build: its ABI inputs, the extension and its hash.

Read by doctor and prestart too, so this module imports neither torch nor transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from qwen_kvprep.common import sha256_file

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
BUILD_LOG = "build.log"
EXTENSION_NAME = "cache_autogptq_cuda_256"

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


def read_manifest(build_dir: Path) -> Optional[dict[str, Any]]:
    """The parsed manifest, or None if it is missing, unreadable or not ours."""
    try:
        data = json.loads((Path(build_dir) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("manifest_version") != MANIFEST_VERSION:
        return None
    if any(k not in data for k in REQUIRED) or not isinstance(data["inputs"], dict):
        return None
    return data


def problem(build_dir: Path, manifest: dict[str, Any], check_hash: bool = True) -> Optional[str]:
    """Why this published build cannot be used, or None if it can."""
    so = Path(build_dir) / str(manifest["so"])
    if not so.is_file():
        return f"{so} is missing"
    if check_hash and sha256_file(so) != manifest["so_sha256"]:
        return f"{so} does not match the sha256 in its manifest (modified or truncated)"
    return None


def list_builds(builds_root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every readable published build, newest first."""
    out: list[tuple[Path, dict[str, Any]]] = []
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


def dumps(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"
