"""Child side: the passage (kvjudge.passage) read through the model's own cache, with its
Int8 cache on and off, for the same numbers the engine smoke's KV table gives vLLM's
caches.

The passage goes through the model's forward CHUNK_TOKENS at a time, each chunk's
attention reading the earlier chunks back from the cache (quantized when the flag is on),
and the log-probabilities of the top TOP_K tokens at each position are kept. The parent
scores them (kvjudge.metrics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwen_kvprep.kvjudge.passage import (
    CHUNK_TOKENS,
    PASSAGE,
    PASSAGE_TOKENS,
    TOP_K,
    passage_ids,
)
from qwen_kvprep.runtime import input_device, restore, set_cache_quantization
from qwen_kvprep.smoke.protocol import KvPassage

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase


def passage_length(model: PreTrainedModel) -> int:
    """PASSAGE_TOKENS, within the context the model's config declares (Qwen's seq_length)."""
    context = getattr(model.config, "seq_length", None) or getattr(
        model.config, "max_position_embeddings", None)
    if isinstance(context, int) and context > 2:
        return min(PASSAGE_TOKENS, context - 1)
    return PASSAGE_TOKENS


def read_through_cache(model: PreTrainedModel, ids: list[int],
                       quantized: bool) -> list[dict[str, float]]:
    """Top-k log-probabilities at each position from the second, the passage fed in chunks
    through the model's cache with its quantization flag set to `quantized`."""
    import torch

    saved = set_cache_quantization(model, quantized)
    device = input_device(model)
    out: list[dict[str, float]] = []
    try:
        with torch.inference_mode():
            past = None
            for start in range(0, len(ids), CHUNK_TOKENS):
                chunk = torch.tensor([ids[start:start + CHUNK_TOKENS]], device=device)
                step = model(input_ids=chunk, past_key_values=past, use_cache=True)
                past = step.past_key_values
                logp = torch.log_softmax(step.logits[0].double(), dim=-1)
                top = torch.topk(logp, TOP_K, dim=-1)
                for values, indices in zip(top.values.tolist(), top.indices.tolist()):
                    out.append({str(i): float(v) for i, v in zip(indices, values)})
    finally:
        restore(saved)
    # the last position predicts a token past the passage: nothing to compare it with
    return out[:-1]


def measure_passage(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> KvPassage:
    ids = passage_ids(lambda t: list(tokenizer.encode(t)), (PASSAGE,), passage_length(model))
    return {"tokens": len(ids), "chunk": CHUNK_TOKENS,
            "quantized": read_through_cache(model, ids, True),
            "unquantized": read_through_cache(model, ids, False)}
