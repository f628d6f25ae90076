"""The bridge to `plan`: its prediction beside every measured row, and the exact cache
size per token that the measured cache bytes are checked against."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep.errors import KvprepError
from qwen_kvprep.planning.model import model_shape
from qwen_kvprep.planning.peak import ModelShape, kv_bytes_per_token, predict_peak_bytes
from qwen_kvprep.profile.protocol import MODES

if TYPE_CHECKING:
    from qwen_kvprep.profile.runner import ProfileRow

# KV-cache bytes of one token per mode (None without a model shape); FAST_INT8 for Int8
# runs through qwen-kvprep's fast path (fp16 scales and zeros)
PerToken = dict[str, Optional[int]]
FAST_INT8 = "int8-fast"


def shape_of(directory: Path, dtype: Optional[str]) -> tuple[Optional[ModelShape], Optional[str]]:
    """plan's view of the model, or why there is none (a refusal of plan's own)."""
    try:
        return model_shape(directory, dtype), None
    except KvprepError as exc:
        return None, exc.message
    except OSError as exc:
        return None, str(exc)


def per_token(shape: Optional[ModelShape]) -> PerToken:
    units = {m: (kv_bytes_per_token(shape, m) if shape is not None else None) for m in MODES}
    units[FAST_INT8] = kv_bytes_per_token(shape, "int8", True) if shape is not None else None
    return units


def fill_predictions(
    rows: list[ProfileRow], shape: Optional[ModelShape], prefill_chunk: Optional[int]
) -> None:
    for row in rows:
        row["predicted_bytes"] = (
            predict_peak_bytes(shape, row["batch"], row["prompt_tokens"], row["new_tokens"],
                               row["mode"], prefill_chunk,
                               fast_path=row["mode"] == "int8" and bool(row.get("fast_layers")))
            if shape is not None
            else None
        )


def unit_of(row: ProfileRow, per_token: PerToken) -> Optional[int]:
    """The bytes per token the row's cache holds: the fast path's for an Int8 run through it."""
    fast = row["mode"] == "int8" and bool(row.get("fast_layers"))
    return per_token.get(FAST_INT8 if fast else row["mode"])


def expected_kv_bytes(row: ProfileRow, per_token: PerToken) -> Optional[int]:
    """batch x cached tokens x bytes per token: what the cache must hold, exactly."""
    unit = unit_of(row, per_token)
    cached = row.get("cached_tokens")
    if unit is None or cached is None:
        return None
    return int(row["batch"]) * int(cached) * unit
