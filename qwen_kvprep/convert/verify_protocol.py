"""What convert's proof (verify.py, the parent) and its child (verify_child.py) agree on:
the phases and the result the child sends.

The child only measures; the parent judges the numbers against the tolerances in
verify.py, so they can be changed and tested without loading a model. Light imports only:
the CLI imports this module without torch.
"""

from __future__ import annotations

from typing import Literal, Optional, TypedDict

RESULT_VERSION = 1

PHASE_START = "start"
PHASE_FIT = "fit"
PHASE_BLOCKS = "blocks"
PHASE_HEAD = "head"
PHASE_LOAD_ORIGINAL = "load-original"
PHASE_LOAD_CONVERTED = "load-converted"
PHASE_WEIGHTS = "weights"
PHASE_LOGITS = "logits"
PHASE_GREEDY = "greedy"
PHASE_TOKENIZER = "tokenizer"
PHASE_CONTEXT = "context"
PHASE_DONE = "done"
PHASE_WORDS = {
    PHASE_START: "starting (importing torch and transformers)",
    PHASE_FIT: "sizing the models against this machine's memory",
    PHASE_BLOCKS: "running both models block by block",
    # after the last block: the heartbeat must not keep saying "block N/N" meanwhile
    PHASE_HEAD: "running both models' heads (final norm and lm_head, the logits)",
    PHASE_LOAD_ORIGINAL: "loading the original through its own code",
    PHASE_LOAD_CONVERTED: "loading the converted folder as Qwen2ForCausalLM",
    PHASE_WEIGHTS: "comparing the loaded weights",
    PHASE_LOGITS: "comparing the logits of a batch of prompts",
    PHASE_GREEDY: "generating greedily with both",
    PHASE_TOKENIZER: "proving the tokenizer and the chat template",
    PHASE_CONTEXT: "measuring past the trained context",
    PHASE_DONE: "done",
}

# The prompts both models read, tokenized by the original's tokenizer (the converted
# folder's tokenizer is proven separately): plain English, a chatml turn with its special
# tokens, code with digits and Chinese, and a short one, so the batch has rows of
# different lengths.
PROMPTS = (
    "The Int8 KV cache stores each key and value in one byte. In short,",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nName three prime numbers.<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    return a + b  # 12345 + 67890\n# 你好，世界\n",
    "Hi",
)
DEFAULT_NEW_TOKENS = 8


class Fit(TypedDict):
    """How much of the model the proof runs on this machine."""

    device: str
    layers_total: int
    layers_run: int
    weights_bytes: int  # one copy, from the safetensors headers
    available_bytes: Optional[int]  # memory the two copies may use; None: unknown
    reason: Optional[str]  # why fewer layers run than the model has


class _LogitDiffBase(TypedDict):
    positions: int
    max_abs: float
    max_rel: float  # max_abs over the largest |logit| of the original at those positions
    scale: float


class LogitDiff(_LogitDiffBase, total=False):
    """Logits of the same inputs, the original's against OUT's."""

    # positions whose logits hold NaN or an infinity, in each model: such positions
    # compare as nothing (NaN is no difference to a max), so they are counted apart
    nonfinite_original: int
    nonfinite_converted: int


class Greedy(TypedDict):
    prompt: int  # index into PROMPTS
    original: list[int]
    converted: list[int]
    first_divergence: Optional[int]
    margin: Optional[float]  # the original's top-1 minus top-2 logit where they diverged


class _WeightsBase(TypedDict):
    compared: int
    differ: list[str]  # "OUT name: why", for every tensor that differs or is missing
    skipped: Optional[str]  # why they were not compared


class Weights(_WeightsBase, total=False):
    # "name: N NaN values (rows 3, 17)", for every original tensor holding NaN (the same
    # bits in OUT are equal: the comparison is of bits, not of values)
    nan: list[str]


class _ProofBase(TypedDict):
    status: Literal["ok", "fail", "unavailable", "error"]
    message: str  # one line: the verdict
    details: object


class Proof(_ProofBase, total=False):
    lines: list[str]  # the proof's own lines after the first (examples, differences)


class ContextRow(TypedDict):
    times: float  # the input's length in multiples of seq_length
    tokens: int
    positions: int  # positions whose logits were compared
    max_abs: Optional[float]
    top1_agreement: Optional[float]  # share of those positions with the same argmax
    skipped: Optional[str]


class ContextMeasure(TypedDict):
    seq_length: int
    rope_scaling: Optional[dict[str, object]]  # OUT's config.json, as it declares it
    original_rules: list[str]  # Qwen's own past seq_length: "dynamic NTK", "logn attention"
    rows: list[ContextRow]


class _ResultBase(TypedDict):
    result_version: int
    torch: str
    transformers: str
    device: str
    dtype_original: str
    dtype_converted: str
    gptq: bool
    # OUT's rope_scaling, set aside for the comparison (measured under `context`)
    scaling_set_aside: Optional[dict[str, object]]
    fit: Fit
    prompt_tokens: list[int]
    logits: LogitDiff  # the padded batch, every real position
    steps: LogitDiff  # the greedy steps while both had read the same tokens
    greedy: list[Greedy]
    weights: Weights
    tokenizer: Proof
    template: Proof
    seconds: dict[str, float]


class VerifyChildResult(_ResultBase, total=False):
    context: ContextMeasure  # only when asked (convert --context-factor)
    # the block-by-block proof (blockproof.py): the hidden states after each block, and
    # the dtype both computed in; `logits` and `weights` are then its own
    blocks: list[LogitDiff]
    compute_dtype: str
    # why the greedy steps did not run (both whole models do not fit); `greedy` is empty
    greedy_skipped: str
