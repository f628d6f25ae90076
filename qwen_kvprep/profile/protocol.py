"""What the profile parent and its children agree on: modes, defaults, phases and the
specification of one child's task. Light imports only (the CLI imports it)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Optional

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

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ChildSpec:
        data: dict[str, Any] = json.loads(text)
        return cls(**data)

