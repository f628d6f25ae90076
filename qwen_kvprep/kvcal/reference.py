"""The reference measurement of a quantized KV cache, on any CPU: OUT read by transformers'
Qwen2ForCausalLM in float32, a passage scored in chunks (chunked prefill), each chunk's
keys and values stored through the cache under test before attention reads them, so that
every later chunk reads the earlier ones from the quantized cache, as an engine's does.

Cache modes (CacheMode): "auto" (float32, unquantized: the reference row), "fp8_e4m3"
with OUT's own k_scale/v_scale tensors ("checkpoint") or with 1.0 for every layer ("1.0":
what an engine does for a folder without scales). K is quantized after rotary, as engines
store it.

`topk_logprobs` gives, for each position but the last, the top-k log-probabilities of the
next token (as an engine's prompt log-probabilities give them), the rows kvjudge scores;
`measure` scores a mode against auto. The whole model is loaded: for small models and
tests (a 7B model needs some 30 GB in float32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep.kvcal import fp8
from qwen_kvprep.kvcal.scales import read_scales
from qwen_kvprep.kvjudge.metrics import Score, TopK, score

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache, PreTrainedModel

MAX_CHUNK = 64  # the bound: later chunks must read earlier ones from the cache
TOP_K = 20  # what vLLM returns at most by default


@dataclass(frozen=True)
class CacheMode:
    dtype: str = "auto"  # "auto" | "fp8_e4m3"
    scales: str = "checkpoint"  # "checkpoint" | "1.0" (fp8 only)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"cache dtype {self.dtype!r}: auto or fp8_e4m3")
        if self.scales not in ("checkpoint", "1.0"):
            raise ValueError(f"scales {self.scales!r}: checkpoint or 1.0")


AUTO = CacheMode()


def _load(out: Path) -> PreTrainedModel:
    """OUT as Qwen2ForCausalLM in float32, its quantization_config set aside (the scales are
    applied here, not by transformers' quantizer)."""
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(str(out))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(40)  # k_scale/v_scale: no parameters of Qwen2
    try:
        kwargs: dict[str, object] = {
            "dtype" if _release() >= (4, 56) else "torch_dtype": torch.float32}
        model = Qwen2ForCausalLM.from_pretrained(
            str(out), config=config, **kwargs)  # type: ignore[arg-type, unused-ignore]
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval()  # type: ignore[no-untyped-call, unused-ignore]
    return model


def _release() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _cache(scales: Optional[list[tuple[float, float]]]) -> DynamicCache:
    """A transformers DynamicCache whose every update stores K and V through fp8 with the
    layer's scales (None: unquantized)."""
    from transformers import DynamicCache

    if scales is None:
        return DynamicCache()
    per_layer = scales

    class Fp8Cache(DynamicCache):  # type: ignore[misc, unused-ignore]
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                   layer_idx: int, *args: object, **kwargs: object,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            k_scale, v_scale = per_layer[layer_idx]
            got: tuple[torch.Tensor, torch.Tensor] = super().update(
                fp8.roundtrip(key_states, k_scale), fp8.roundtrip(value_states, v_scale),
                layer_idx, *args, **kwargs)
            return got

    return Fp8Cache()


def layer_scales(out: Path, mode: CacheMode, layers: int) -> Optional[list[tuple[float, float]]]:
    """Each layer's (k_scale, v_scale) for `mode`; None for auto."""
    if mode.dtype == "auto":
        return None
    if mode.scales == "1.0":
        return [(1.0, 1.0)] * layers
    found = read_scales(out)
    if found is None:
        raise ValueError(f"{out} holds no k_scale/v_scale tensors")
    if len(found) != layers:
        raise ValueError(f"{out} holds scales for {len(found)} layers, its model has {layers}")
    return found


def topk_logprobs(
    out: Path, ids: Sequence[int], mode: CacheMode = AUTO, *, chunk: int = MAX_CHUNK,
    top_k: int = TOP_K, model: Optional[PreTrainedModel] = None,
    scales: Optional[list[tuple[float, float]]] = None,
) -> list[TopK]:
    """Per position 0..n-2 of `ids`, the top-k log-probabilities of the next token, the
    passage read in chunks of `chunk` tokens through the cache `mode` says (`scales`: each
    layer's (k, v) scales in place of those `mode` names, for fp8)."""
    import torch

    if not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be 1..{MAX_CHUNK}, not {chunk}")
    if len(ids) < 2:
        raise ValueError("a passage of at least two tokens")
    model = _load(out) if model is None else model
    layers = int(model.config.num_hidden_layers)
    if scales is not None and mode.dtype == "auto":
        raise ValueError("scales given for an unquantized cache")
    cache = _cache(scales if scales is not None else layer_scales(out, mode, layers))
    rows: list[TopK] = []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = torch.tensor([list(ids[start:start + chunk])])
            logits = model(input_ids=piece, past_key_values=cache, use_cache=True).logits[0]
            logp = torch.log_softmax(logits.float(), dim=-1)
            values, indices = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
            for v, i in zip(values.tolist(), indices.tolist()):
                rows.append(dict(zip(i, v)))
    return rows[:len(ids) - 1]


def measure(out: Path, ids: Sequence[int], mode: CacheMode, *, chunk: int = MAX_CHUNK,
            top_k: int = TOP_K) -> Score:
    """`mode` scored against auto on the same passage (kvjudge.metrics)."""
    model = _load(out)
    ref = topk_logprobs(out, ids, AUTO, chunk=chunk, top_k=top_k, model=model)
    test = topk_logprobs(out, ids, mode, chunk=chunk, top_k=top_k, model=model)
    return score(ref, test)


__all__ = [
    "AUTO",
    "MAX_CHUNK",
    "TOP_K",
    "CacheMode",
    "layer_scales",
    "measure",
    "topk_logprobs",
]
