"""Where the shipped kernel sources and templates are, installed or in a checkout."""

from __future__ import annotations

from pathlib import Path

from qwen_kvprep.common import KERNEL_FILES, sha256_file

__all__ = ["KERNEL_FILES", "kernels_dir", "templates_dir", "vendored_kernel_hashes"]

_PKG = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    # A wheel carries them inside the package (_data/); a checkout or an editable
    # install has them at the top level beside the package.
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"qwen-kvprep installation is incomplete: no {name}/ folder")


def kernels_dir() -> Path:
    return _data_dir("kernels")


def templates_dir() -> Path:
    return _data_dir("templates")


def vendored_kernel_hashes() -> dict[str, str]:
    """sha256 of our own kernel sources, as installed."""
    d = kernels_dir()
    return {name: sha256_file(d / name) for name in KERNEL_FILES}
