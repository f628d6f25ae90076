"""`profile --quality` (child side): what the Int8 cache does to the model's predictions.

The text is teacher-forced through both caches in lockstep on one loaded model (the same
weights; the mode is switched per forward with the layers' use_cache_quantization flag,
each mode keeping its own cache):

- the first QUALITY_PREFILL_TOKENS tokens go in as one chunk, as a prompt would;
- every later token goes in alone, with the cache, as in decoding.

Why through the cache, and why this split: the quantized cache is what is being judged,
and its error depends on how it was filled. The remote code quantizes each chunk of keys
and values with one scale and zero point per (row, head) over the whole chunk: a long
prompt is stored coarsely, a decoded token finely (its own scale). One forward over the
whole text would be a single prefill chunk, and would measure neither the coarse prompt
part as it serves later tokens nor the decoding path at all. Feeding the prompt part at
once and the rest token by token reproduces what a chat turn stores, and every position
after the prompt reads the prompt and all decoded tokens from the quantized cache. (The
quantized path differs from the first chunk on already, since attention reads the
quantized keys and values of the current chunk too, so the prompt positions are scored
as well.)

Metrics over all positions that have a next token (T - 1 of a T-token text):
top-1 agreement of the two modes' argmax, the perplexity of the text under each mode,
and the mean and max absolute difference of the logits (fp32, over the vocabulary).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep.childproc import Events
from qwen_kvprep.profile.passage import PASSAGE
from qwen_kvprep.profile.protocol import PHASE_QUALITY, ChildSpec, QualityResult
from qwen_kvprep.runtime import (
    KernelCounter,
    attention_layers,
    input_device,
    pretrained_tokenizer,
    restore,
    set_cache_quantization,
)

if TYPE_CHECKING:
    import torch
    from transformers.modeling_utils import PreTrainedModel

    from qwen_kvprep.runtime import ModelOutput

QUALITY_PREFILL_TOKENS = 32
# A long TEXTFILE is cut here: 2 x this many forwards is already minutes on a large model.
QUALITY_MAX_TOKENS = 2048
# Without a tokenizer (random weights from a config alone) the text is seeded random ids.
QUALITY_SYNTHETIC_TOKENS = 512


def text_ids(spec: ChildSpec, vocab: int) -> tuple[list[int], str]:
    """The token ids to score and where they come from."""
    if spec.random_weights:
        import torch

        gen = torch.Generator().manual_seed(spec.seed + 1)
        drawn = torch.randint(0, vocab, (QUALITY_SYNTHETIC_TOKENS,), generator=gen)
        ids: list[int] = drawn.tolist()
        return ids, "synthetic token ids (random weights: no tokenizer is used)"
    tokenizer = pretrained_tokenizer(spec.source)
    if spec.text_file:
        text = Path(spec.text_file).read_text(encoding="utf-8", errors="replace")
        where = spec.text_file
    else:
        text, where = PASSAGE, "built-in passage"
    ids = list(tokenizer.encode(text))[:QUALITY_MAX_TOKENS]
    if len(ids) < 2:
        raise ValueError(f"{where} has {len(ids)} token(s); at least 2 are needed")
    return ids, where


def _perplexity(nll_sum: float, tokens: int) -> Optional[float]:
    # None rather than inf: JSON has no infinity, and a model this lost (random weights
    # gone wrong) has no meaningful perplexity anyway
    mean = nll_sum / tokens
    return math.exp(mean) if mean < 700 else None


def run_quality(
    model: PreTrainedModel, spec: ChildSpec, device: str, ev: Events
) -> QualityResult:
    import torch
    import torch.nn.functional as F

    ids_list, source = text_ids(spec, int(model.config.vocab_size))
    ids = torch.tensor([ids_list], dtype=torch.long, device=input_device(model))
    total = ids.shape[1]
    prefill = min(QUALITY_PREFILL_TOKENS, total - 1)
    spans = [(0, prefill)] + [(t, t + 1) for t in range(prefill, total - 1)]

    layers = attention_layers(model)
    counter = KernelCounter(layers)
    past: dict[bool, object] = {False: None, True: None}
    agree = 0
    nll = {False: 0.0, True: 0.0}
    abs_sum = 0.0
    abs_max = 0.0
    values = 0
    ev.start(PHASE_QUALITY)
    with torch.inference_mode():
        for i, (a, b) in enumerate(spans):
            logits: dict[bool, torch.Tensor] = {}
            for quantized in (False, True):
                saved = set_cache_quantization(model, quantized)
                try:
                    out: ModelOutput = model(input_ids=ids[:, a:b], past_key_values=past[quantized],
                                use_cache=True)
                finally:
                    restore(saved)
                past[quantized] = out.past_key_values
                logits[quantized] = out.logits[0].float()
                del out
            targets = ids[0, a + 1 : b + 1]
            u, q = logits[False], logits[True]
            agree += int((u.argmax(-1) == q.argmax(-1)).sum())
            for quantized in (False, True):
                nll[quantized] += float(F.cross_entropy(logits[quantized], targets,
                                                        reduction="sum"))
            diff = (u - q).abs()
            abs_sum += float(diff.sum())
            abs_max = max(abs_max, float(diff.max()))
            values += diff.numel()
            if i % 32 == 0:
                ev.send({"event": "progress", "phase": PHASE_QUALITY, "done": b,
                         "total": total - 1})
    scored = total - 1
    return {
        "tokens": scored,
        "text": source,
        "prefill_tokens": prefill,
        "top1_agreement": agree / scored,
        "ppl_unquantized": _perplexity(nll[False], scored),
        "ppl_int8": _perplexity(nll[True], scored),
        "mean_abs_logit_diff": abs_sum / values,
        "max_abs_logit_diff": abs_max,
        "layers": len(layers),
        "kernel_layers": counter.kernel_layers(),
    }
