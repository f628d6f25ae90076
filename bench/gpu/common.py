"""What bench/gpu/prepare and bench/gpu/run both need: the hash that ties a bundle's
project wheel to the checkout it was built from."""

from __future__ import annotations

import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sources_hash(root: Path = ROOT) -> str:
    """sha256 over the files the project wheel is built from (paths and contents)."""
    h = hashlib.sha256()
    for top in ("qwen_kvprep", "kernels", "templates", "pyproject.toml"):
        base = root / top
        files = [base] if base.is_file() else sorted(base.rglob("*"))
        for f in files:
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(root)).encode() + b"\0")
                h.update(f.read_bytes())
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
