"""The passage every KV cache is scored on, and how it is read.

The text is convert's proof corpus's hand-written part (`convert.corpus.fixed()`, given by
the caller: many scripts, code, whitespace, emoji), so a model meets its own tokenizer's
full range. It is read in chunks of
CHUNK_TOKENS with the cache quantized: each chunk's attention reads every earlier chunk back
from the cache, so what the cache stores is what is scored (a single pass over the whole
passage would attend to the unquantized K and V of its own forward). TOP_K log-probabilities
a position are what vLLM returns by default (max_logprobs 20).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

PASSAGE_TOKENS = 512
# fewer than this and the table says too little to judge a cache by
MIN_TOKENS = 400
CHUNK_TOKENS = 32
TOP_K = 20


def passage_ids(encode: Callable[[str], list[int]], texts: Sequence[str],
                limit: int = PASSAGE_TOKENS) -> list[int]:
    """The first `limit` token ids of `texts` joined by blank lines, as `encode` gives them
    (the text repeated when a tokenizer packs it into fewer)."""
    if limit < 2:
        raise ValueError(f"a passage needs at least 2 tokens, not {limit}")
    text = "\n\n".join(texts)
    ids = list(encode(text))
    if not ids:
        raise ValueError("the tokenizer encodes the passage as no tokens")
    while len(ids) < limit:
        ids += list(encode("\n\n" + text))
    return ids[:limit]
