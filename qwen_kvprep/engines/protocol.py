"""What the engine smoke's parent (runner.py) and its children (reference_child.py,
vllm_child.py) agree on: the phases, the options and the results the children send.

The children only measure; the parent compares (compare.py). Light imports only: the CLI
imports this module without torch.
"""

from __future__ import annotations

from typing import Optional, TypedDict

RESULT_VERSION = 1

ENGINES = ("transformers", "vllm")
# Greedy tokens per prompt: enough steps for a quantized cache to move a token on the
# proof's prompts (fp8 parts from auto after 3-12 steps on a tiny model), few enough for
# a CPU. The prompts are the proof's (convert.verify_protocol.PROMPTS).
DEFAULT_NEW_TOKENS = 16
DEFAULT_TIMEOUT_S = 1200.0
# The comparison runs in float32: in bf16 a tiny random model is full of exact ties, and
# sequences part there for no reason but rounding.
DTYPE = "float32"

PHASE_LOAD_CONVERTED = "load-converted"
PHASE_LOAD_ORIGINAL = "load-original"
PHASE_GENERATE = "generate"
PHASE_IMPORT_ENGINE = "import-engine"
PHASE_START_ENGINE = "start-engine"
PHASE_SCORE = "score"
PHASE_WORDS = {
    "start": "starting (importing torch and transformers)",
    PHASE_LOAD_CONVERTED: "loading OUT as Qwen2ForCausalLM in transformers",
    PHASE_LOAD_ORIGINAL: "loading the original through its own code",
    PHASE_GENERATE: "generating greedily",
    PHASE_IMPORT_ENGINE: "importing the engine",
    PHASE_START_ENGINE: "starting the engine (loading OUT, sizing its KV cache)",
    PHASE_SCORE: "scoring the passage through the KV cache",
    "done": "done",
}


class Run(TypedDict):
    """One prompt's greedy continuation as one backend produced it."""

    prompt: int  # index into the prompts
    tokens: list[int]
    logprobs: list[float]  # the log-probability of each chosen token
    gaps: list[float]  # top-1 minus top-2 logit at each step (a log-probability difference)


class Backend(TypedDict):
    """What one backend (transformers on OUT, the original, the engine with one KV cache
    dtype) generated for every prompt."""

    name: str
    runs: list[Run]
    scale: Optional[float]  # the largest |logit| seen (transformers only; None for engines)
    seconds: float


class ReferenceResult(TypedDict):
    """reference_child.py: transformers' Qwen2 on OUT, and the original through its own
    code where it was asked for."""

    result_version: int
    torch: str
    transformers: str
    dtype: str
    prompt_tokens: list[list[int]]  # the prompts as OUT's tokenizer encodes them
    converted: Backend
    original: Optional[Backend]


# KV scales a run serves with: the folder's own (config.json's kv_cache_scheme and its
# k_scale/v_scale tensors), or none (the engine then takes 1.0)
SCALES_CHECKPOINT = "checkpoint"
SCALES_UNIT = "1.0"


class EngineRun(TypedDict):
    """One engine start the parent asks for."""

    dtype: str  # the KV cache dtype
    folder: str  # OUT, or OUT's view without its KV scales
    scales: str  # SCALES_CHECKPOINT or SCALES_UNIT
    reference: bool  # the unquantized cache: also generates the prompts greedily (parity)


class EngineResult(TypedDict):
    """vllm_child.py: one engine start with one KV cache dtype."""

    result_version: int
    engine: str
    version: str
    kv_cache_dtype: str  # as asked for
    resolved_kv_cache_dtype: str  # as the engine's cache config holds it
    dtype: str
    scales: str
    reference: bool
    backend: Optional[Backend]  # the greedy runs, for the reference only
    # the passage's prompt log-probabilities: per position from the second, token id (as
    # a string: JSON) -> log-probability, for the engine's top-k there
    scored: list[dict[str, float]]
    chunk: int  # the most prompt tokens a step read (max_num_batched_tokens)
    # the scales the engine's attention layers hold after loading, in layer order
    engine_k_scale: list[float]
    engine_v_scale: list[float]
