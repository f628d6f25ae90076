"""fp8 e4m3 as engines use it for a KV cache: one float32 scale per layer for K and one for
V; a value x is stored as fp8(x / scale), saturated at the format's largest finite value,
and read back as that code times the scale."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch.float8_e4m3fn's largest finite value (it has no infinity: past it lies NaN)
E4M3_MAX = 448.0
# the smallest scale written: a layer whose K or V is all zeros still gets a usable scale
# (llm-compressor clamps the same way, to float32's eps)
MIN_SCALE = 1.1920928955078125e-07


def scale_of(absmax: float) -> float:
    """The static per-tensor scale for values up to `absmax` (what llm-compressor computes
    for fp8 e4m3: absmax / 448), as float32 stores it."""
    import struct

    if not absmax >= 0.0 or absmax == float("inf"):
        raise ValueError(f"absmax must be finite and >= 0, not {absmax}")
    value = max(absmax / E4M3_MAX, MIN_SCALE)
    return float(struct.unpack("f", struct.pack("f", value))[0])


def scales_of(absmax: Sequence[float]) -> list[float]:
    return [scale_of(a) for a in absmax]


def has_fp8() -> bool:
    import torch

    return getattr(torch, "float8_e4m3fn", None) is not None


def roundtrip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an fp8 e4m3 cache with `scale` gives it back: divided by the scale, saturated
    at +-448 (engines' conversion saturates; torch's own cast would give NaN past it),
    rounded to e4m3, multiplied by the scale, in x's dtype."""
    import torch

    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        raise RuntimeError(f"torch {torch.__version__} has no float8_e4m3fn")
    y = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(fp8)
    return (y.float() * scale).to(x.dtype)
