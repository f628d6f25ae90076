"""What the profile parent and its children agree on: modes, defaults, phases, the
specification of one child's task and what a child answers. Light imports only (the CLI
imports it)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional, TypedDict

MODES = ("unquantized", "int8")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("bf16", "fp16")

# Qwen's published memory table (batch 1 to 100, 1024 new tokens) on a GPU; on a CPU
# something that finishes in seconds on the tiny checkpoint.
GPU_BATCHES = (1, 4, 16, 32, 64, 100)
GPU_NEW_TOKENS = 1024
CPU_BATCHES = (1, 2)
CPU_NEW_TOKENS = 16
# A short prompt, as in a chat turn; long enough that prefill throughput means something.
DEFAULT_PROMPT_TOKENS = 32
# Loading a 72B checkpoint from a network disk, or building the extension on first use,
# takes many minutes; one run of a tiny one seconds.
DEFAULT_TIMEOUT_S = 1800.0
# Fixed, so two profiles of the same config build the same random model.
RANDOM_SEED = 0

# Test-only: a child whose batch is above this many rows raises the out-of-memory error
# of its device where it would allocate the batch, as a real allocator failure would.
ENV_SIMULATE_OOM = "QWEN_KVPREP_PROFILE_SIMULATE_OOM_ABOVE"

TASK_PROBE = "probe"  # device and versions only
TASK_RUN = "run"  # one (mode, batch) generation
TASK_QUALITY = "quality"  # teacher-forced comparison of both modes

PHASE_LOAD = "load"
PHASE_PREFILL = "prefill"
PHASE_DECODE = "decode"
PHASE_QUALITY = "teacher-forcing"
PHASE_WORDS = {
    "start": "starting",
    PHASE_LOAD: "loading the model",
    PHASE_PREFILL: "prefill",
    PHASE_DECODE: "decoding",
    PHASE_QUALITY: "teacher forcing",
    "done": "done",
}


@dataclass(frozen=True)
class ChildSpec:
    """One child's task; travels as JSON on its command line."""

    task: str
    source: str  # the folder transformers loads from
    device: str = "auto"
    mode: str = "int8"
    batch: int = 1
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    new_tokens: int = CPU_NEW_TOKENS
    prefill_chunk: Optional[int] = None
    dtype: Optional[str] = None  # None: as config.json says (or the model decides)
    random_weights: bool = False
    # copy the loader and the kernel sources beside the modules-cache copy of the model
    # code before loading (an assembled folder, whose modules cache is private)
    plant_kernels: bool = False
    text_file: Optional[str] = None  # quality: None for the built-in passage
    seed: int = RANDOM_SEED
    # False: switch torch's cuDNN attention backend off before loading (the unquantized
    # cache's SDPA call; the Int8 cache's attention does not use SDPA)
    cudnn_attention: bool = True
    # False: the Int8 cache runs the model's own code even where qwen-kvprep's fast path is
    # installed (qwen_kvprep_kv.py; every attention layer gets its off switch)
    fast_path: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ChildSpec:
        # what to_json wrote: this class's own fields
        return cls(**json.loads(text))


# -- what a child answers ----------------------------------------------------------------


class _Device(TypedDict):
    kind: str  # "cuda" or "cpu"
    name: str
    total_bytes: Optional[int]  # None: the host's memory could not be read


class DeviceInfo(_Device, total=False):
    """The device measured; the other keys depend on its kind."""

    # cuda
    capability: str  # "9.0"
    count: int
    cudnn_attention: Optional[bool]  # None: a torch without a cuDNN attention backend
    # cpu
    threads: int


class Versions(TypedDict):
    qwen_kvprep: str
    torch: str
    torch_cuda: Optional[str]
    transformers: str
    python: str


class ProbeResult(TypedDict):
    """Every child's answer starts with this; the probe's is nothing else."""

    device: DeviceInfo
    versions: Versions


class Loaded(TypedDict, total=False):
    """What loading the model measured (load() fills every key; not total, as Generation,
    so that RunAnswer, which holds what a run got to, can declare them by inheriting)."""

    dtype: str  # as the model was loaded: bf16, fp16 or fp32
    load_seconds: float
    load_warnings: list[str]


class Generation(TypedDict, total=False):
    """The prefill and decode of one run (generate() fills every key)."""

    cached_tokens: Optional[int]
    kv_bytes: int
    prefill_seconds: float
    decode_seconds: float
    prefill_tokens_per_s: Optional[float]
    decode_tokens_per_s: Optional[float]


class QualityResult(TypedDict):
    """The teacher-forced comparison of both caches (the "quality" object of --json)."""

    tokens: int  # positions scored
    text: str  # where the text came from
    prefill_tokens: int
    top1_agreement: float
    ppl_unquantized: Optional[float]  # None: out of range
    ppl_int8: Optional[float]
    mean_abs_logit_diff: float
    max_abs_logit_diff: float
    layers: int
    kernel_layers: int


class RunAnswer(Loaded, Generation, total=False):
    """What a run adds to the probe's answer: `oom` and `error`, what `Loaded` and
    `Generation` hold as far as it got before running out of memory (in `oom_phase`), the
    kernel counts and the memory peak. A quality run adds `Loaded` alone."""

    oom: bool
    error: Optional[str]
    layers: int  # attention layers
    oom_phase: str
    kernel_layers: int  # layers that called the compiled kernel
    kernel_calls: list[int]  # per layer
    fast_layers: int  # layers that ran qwen-kvprep's fast path
    peak_bytes: int


class RunResult(ProbeResult, RunAnswer):
    """The answer of a run."""


class QualityRunResult(ProbeResult, Loaded):
    """The answer of a quality run."""

    quality: QualityResult


class ProfileResult(ProbeResult, RunAnswer, total=False):
    """A child's answer as the parent reads it, whatever the task: the probe's, a
    RunResult or a QualityRunResult."""

    quality: QualityResult
