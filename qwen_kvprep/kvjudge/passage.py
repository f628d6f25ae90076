"""The passage every KV cache is scored on, and how it is read.

The text (PASSAGE: prose, Chinese and code) is not part of the default calibration text
(convert's proof corpus), so a calibrated cache is judged on text it was not calibrated
on, by every backend alike (vLLM's rows, Qwen's own Int8 cache, the CPU reference). It is
read in chunks of
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

PASSAGE = (
    "A key-value cache keeps, for every layer of a transformer, the keys and values of the "
    "tokens it has already read, so that each new token attends to them without computing "
    "them again. Its size grows with the context: for a model of thirty-two layers with "
    "thirty-two heads of one hundred and twenty-eight dimensions, every token costs half a "
    "megabyte in sixteen-bit floats. Storing it in eight bits halves that, and a server then "
    "holds twice as many conversations at once. The price is rounding. An eight-bit float "
    "of the e4m3 kind has four bits of exponent and three of mantissa, and nothing above "
    "four hundred and forty-eight; a value past that saturates, and the attention that reads "
    "it sees a different key. A scale per layer, measured on real text, moves every value "
    "into range before it is stored and back after it is read.\n\n"
    "长上下文的推理需要大量显存。量化键值缓存可以节省一半的内存，但是如果缩放因子不合适，"
    "模型的输出就会出错。我们在真实文本上测量每一层的最大值，然后据此计算缩放因子。\n\n"
    "def attention(q, k, v, scale):\n"
    "    scores = (q @ k.transpose(-1, -2)) * scale\n"
    "    weights = scores.softmax(dim=-1)\n"
    "    return weights @ v  # 128 dims per head, 32 heads, 4096 tokens\n\n"
    "The measurement is simple. Read the calibration text through the model one block at a "
    "time, and at every attention layer note the largest magnitude among the keys, after "
    "the rotary embedding has turned them, and among the values. Divide each by 448. Write "
    "the quotients beside the weights, under the names the engines look for, and declare "
    "in the configuration that the cache is eight-bit float, static, one scale per tensor. "
    "An engine that finds them uses them; one that does not falls back to a scale of one, "
    "which is only right for a model whose keys and values already lie within range. "
    "Whether they do is a property of the weights: Qwen's attention has a bias on its "
    "query, key and value projections, and some of its layers produce keys in the "
    "thousands. 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987.\n"
)


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
