"""The plan's vocabulary: a tensor as a header describes it, and one output tensor's source."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TensorInfo:
    """What a file's header says of one tensor."""

    dtype: str  # torch's name without the prefix: "bfloat16", "float16", "float32", "int32"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """One output tensor: `source`, or its slice [start, stop) along `dim` (None: all of it)."""

    target: str
    source: str
    dim: Optional[int] = None
    start: int = 0
    stop: int = 0
