"""What the smoke parent and its child agree on: defaults, phases and the event format.

The child writes one JSON object per line to a dedicated file descriptor (never to stdout
or stderr, where model code and compilers print whatever they like):

    {"event": "phase", "phase": "load"}            a phase starts
    {"event": "error", "phase": ..., "type": ..., "message": ..., "traceback": ...}
    {"event": "result", "result": {...}}            everything measured: SmokeResult

Kept free of heavy imports: both the CLI process and the child import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional, TypedDict

if TYPE_CHECKING:
    from qwen_kvprep.runtime import KernelInfo

RESULT_VERSION = 1

# A fixed prompt so runs are comparable across machines and versions. It is plain English
# that any byte-level BPE tokenizer encodes into a dozen or more tokens, and its length
# in tokens is odd for Qwen's tokenizer, so the kernels see odd and even cache lengths.
DEFAULT_PROMPT = "The Int8 KV cache stores each key and value in one byte. In short,"
DEFAULT_MAX_NEW_TOKENS = 16
# Loading a 72B checkpoint from a network disk can take many minutes; a tiny one seconds.
DEFAULT_TIMEOUT_S = 900.0

DEVICES = ("auto", "cpu", "cuda")

# Phases in the order the child runs them. A crash or hang is attributed to the last
# phase announced: "load" problems are smoke.load findings, the rest smoke.run.
PHASE_START = "start"
PHASE_LOAD = "load"
PHASE_INSPECT = "inspect"
PHASE_WARMUP = "warm-up"
PHASE_QUANTIZED = "generate-quantized"
PHASE_OWN_CODE = "generate-own-code"
PHASE_KV_PASSAGE = "kv-passage"
PHASE_UNQUANTIZED = "generate-unquantized"
PHASE_DONE = "done"
LOAD_PHASES = (PHASE_START, PHASE_LOAD)
PHASE_WORDS = {
    PHASE_START: "starting (importing torch and transformers)",
    PHASE_LOAD: "loading the model",
    PHASE_INSPECT: "inspecting the layers",
    PHASE_WARMUP: "warming up (a few untimed tokens with each cache)",
    PHASE_QUANTIZED: "generating with the quantized cache",
    PHASE_OWN_CODE: "generating with the model's own Int8 code (the fast path set aside)",
    PHASE_UNQUANTIZED: "generating with the unquantized cache",
    PHASE_KV_PASSAGE: "scoring a passage through the Int8 cache and the unquantized one",
    PHASE_DONE: "done",
}

# What Qwen's modeling code warns when a layer falls back to the pure-torch path.
FALLBACK_WARNINGS = (
    "KV cache kernel source files (.cpp and .cu) not found.",
    "Failed to import KV cache kernels.",
)


# -- the result --------------------------------------------------------------------------


class LayerRow(TypedDict):
    """One attention layer of the loaded model."""

    name: str
    use_cache_quantization: bool
    use_cache_kernel: bool
    kernel: KernelInfo
    kernel_calls: int  # calls into the extension during the quantized run
    # the model's code imports qwen-kvprep's fast path (qwen_kvprep_kv.py), and the
    # attention steps this layer ran through it during the quantized run
    fast_path_installed: bool
    fast_steps: int


class _CacheLayout(TypedDict):
    bytes: int
    layout: Literal["quantized", "plain", "unknown"]


class CacheLayer(_CacheLayout, total=False):
    """One layer's cache entry after the prompt; which other keys it has depends on the
    layout."""

    # quantized: ((q, scale, zero), (q, scale, zero))
    q_dtype: str
    v_dtype: str
    q_shape: list[int]
    scale_shape: list[int]
    zero_shape: list[int]
    scale_dtype: str
    scale_bytes: int
    heads: Optional[int]
    head_dim: Optional[int]
    per_token: bool  # one scale and zero point per token and head
    # plain: (key, value)
    dtype: str
    shape: list[int]
    element_bytes: int


class CacheSummary(TypedDict):
    layers: list[CacheLayer]
    bytes_per_token: float


class PeakMemory(TypedDict):
    kind: Literal["cuda_max_allocated", "rss_high_water"]
    bytes: int


class ModeRun(TypedDict):
    """One greedy generation with one cache."""

    tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    decode_tokens_per_s: Optional[float]
    cache: CacheSummary
    peak_memory: PeakMemory
    text: str


class QuantizedRun(ModeRun):
    enabled: bool  # whether the model as configured has the quantized cache on


class FirstStep(TypedDict):
    """The first generated token's logits, quantized against unquantized."""

    max_abs_logit_diff: float
    logit_range: float
    argmax_quantized: int
    argmax_unquantized: int


class Comparison(TypedDict):
    """Both runs compared while they share a prefix."""

    tokens: int
    identical_tokens: int
    first_divergence: Optional[int]
    steps_compared: int
    max_abs_logit_diff: float
    max_rel_logit_diff: float
    divergence_margin: Optional[float]
    divergence_rel_margin: Optional[float]


class OwnCode(TypedDict):
    """Where the quantized run went through qwen-kvprep's fast path: the same generation
    with the fast path set aside in every layer (the model's own Int8 code), compared with
    it. The fast path stands in only for code it reproduces: the tokens must be the same."""

    tokens: list[int]
    fast_steps: int  # attention steps that went through the fast path all the same
    comparison: Comparison  # the fast path's run against this one


class GptqModules(TypedDict):
    """How the linear layers ran, for a GPTQ checkpoint (config.json's quantization_config)."""

    blocks: int  # attention layers, one per transformer block
    modules: int  # modules holding GPTQ-packed weights (qweight, qzeros, scales)
    classes: dict[str, int]  # their classes, "module.Class" -> count
    called: int  # of them, how many ran during the quantized run
    calls: int  # their forward calls during the quantized run
    plain_linears: list[str]  # nn.Linear modules left inside the blocks


class LoadedNumbers(TypedDict):
    """Whether the loaded model holds the checkpoint's numbers (smoke/numbers.py)."""

    tensors_compared: int
    tensors_stored: int
    tensors_differ: int
    tensors_differ_names: list[str]
    buffers_compared: int
    buffers_differ: int
    buffers_differ_names: list[str]
    seconds: float


class KvPassage(TypedDict):
    """The passage (kvjudge.passage) read through the model's cache in chunks, its Int8
    cache on and off: per position from the second, token id (a string: JSON) ->
    log-probability, for the top-k there."""

    tokens: int
    chunk: int
    quantized: list[dict[str, float]]
    unquantized: list[dict[str, float]]


class _SmokeResultBase(TypedDict):

    result_version: int
    device: str
    device_name: str
    torch: str
    torch_cuda: Optional[str]
    transformers: str
    cpu_threads: int
    prompt: str
    max_new_tokens: int
    load_seconds: float
    load_warnings: list[str]
    model_dtype: str
    model_code: Optional[str]
    compat: list[str]  # what qwen_kvprep_compat.py installed on this transformers
    numbers: LoadedNumbers
    peak_after_load: PeakMemory
    layers: list[LayerRow]
    prompt_tokens: int
    first_step: FirstStep
    comparison: Comparison
    quantized: QuantizedRun
    unquantized: ModeRun
    peak_memory: PeakMemory


class SmokeResult(_SmokeResultBase, total=False):
    """Everything the child measured (the "result" event); `gptq` for GPTQ checkpoints;
    `own_code` where the quantized run went through the fast path, unless
    `per_token_prefill` (fix --per-token-prefill: other numbers than the model's by
    design) left the comparison out; `kv_passage` where the Int8 cache is on."""

    gptq: GptqModules
    own_code: OwnCode
    per_token_prefill: bool
    kv_passage: KvPassage
