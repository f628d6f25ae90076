"""Where the shipped kernel sources and templates are, installed or in a checkout."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_PKG = Path(__file__).resolve().parent

KERNEL_FILES = ("cache_autogptq_cuda_256.cpp", "cache_autogptq_cuda_kernel_256.cu")


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


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """sha256 of a regular file (symlinks followed); OSError for anything else, without
    blocking on a FIFO (untrusted.NotRegularFile)."""
    from qwen_kvprep.untrusted import open_regular

    h = hashlib.sha256()
    fd = open_regular(path)
    try:
        for chunk in iter(lambda: os.read(fd, 1 << 20), b""):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def vendored_kernel_hashes() -> dict[str, str]:
    """sha256 of our own kernel sources, as installed."""
    d = kernels_dir()
    return {name: sha256_file(d / name) for name in KERNEL_FILES}
