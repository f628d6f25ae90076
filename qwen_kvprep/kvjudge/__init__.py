"""Judging a quantized KV cache by what it changes: the next-token distributions of a
passage read through the cache, against the same passage through the unquantized cache.

Pure functions over log-probabilities (no torch, no engine): every backend that can score
a passage (vLLM's prompt log-probabilities, transformers with a quantized cache, Qwen's own
Int8 cache) hands its numbers here, so every row of every KV table is judged the same way.
"""
