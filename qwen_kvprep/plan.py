"""STAND-IN for the plan module (issue 14): replaced at merge by the real
qwen_kvprep/plan.py of the `plan` branch.

It has exactly the signatures of /work/notes/plan-contract.md so that `profile` can import
`predicted_bytes` from it. kv_bytes_per_token is exact; model_shape and predict_peak_bytes
are deliberately rough (weights from config.json alone, peak = weights + cache at the
final length + one prefill chunk's fp32 logits). Nothing else belongs here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep.errors import ConfigError

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    dtype_bytes: int
    weights_bytes: int


def model_shape(checkpoint: Path, dtype: Optional[str] = None) -> ModelShape:
    path = Path(checkpoint) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        intermediate = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: {exc}", fix="check config.json") from exc
    if dtype is None:
        dtype = next((d for d in ("bf16", "fp16", "fp32") if cfg.get(d)), "bf16")
    e = _DTYPE_BYTES.get(dtype, 2)
    head_dim = int(cfg.get("kv_channels", hidden // heads))
    ff = intermediate // 2
    per_layer = 4 * hidden * hidden + 3 * hidden + 3 * hidden * ff + 2 * hidden
    params = 2 * vocab * hidden + layers * per_layer + hidden
    return ModelShape(layers, heads, head_dim, hidden, intermediate, vocab, e, params * e)


def kv_bytes_per_token(shape: ModelShape, mode: str) -> int:
    e = shape.dtype_bytes
    if mode == "int8":
        return 2 * shape.layers * shape.heads * (shape.head_dim + 2 * e)
    return 2 * shape.layers * shape.heads * shape.head_dim * e


def predict_peak_bytes(
    shape: ModelShape,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    mode: str,
    prefill_chunk: Optional[int] = None,
) -> int:
    tokens = prompt_tokens + new_tokens
    chunk = min(prefill_chunk or prompt_tokens, prompt_tokens)
    cache = batch * tokens * kv_bytes_per_token(shape, mode)
    logits = batch * chunk * shape.vocab * 4
    return shape.weights_bytes + cache + logits
