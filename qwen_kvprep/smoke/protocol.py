"""What the smoke parent and its child agree on: defaults, phases and the event format.

The child writes one JSON object per line to a dedicated file descriptor (never to stdout
or stderr, where model code and compilers print whatever they like):

    {"event": "phase", "phase": "load"}            a phase starts
    {"event": "error", "phase": ..., "type": ..., "message": ..., "traceback": ...}
    {"event": "result", "result": {...}}            everything measured (see child.py)

Kept free of heavy imports: both the CLI process and the child import it.
"""

from __future__ import annotations

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
PHASE_UNQUANTIZED = "generate-unquantized"
PHASE_DONE = "done"
LOAD_PHASES = (PHASE_START, PHASE_LOAD)
PHASE_WORDS = {
    PHASE_START: "starting (importing torch and transformers)",
    PHASE_LOAD: "loading the model",
    PHASE_INSPECT: "inspecting the layers",
    PHASE_WARMUP: "warming up (a few untimed tokens with each cache)",
    PHASE_QUANTIZED: "generating with the quantized cache",
    PHASE_UNQUANTIZED: "generating with the unquantized cache",
    PHASE_DONE: "done",
}

# What Qwen's modeling code warns when a layer falls back to the pure-torch path.
FALLBACK_WARNINGS = (
    "KV cache kernel source files (.cpp and .cu) not found.",
    "Failed to import KV cache kernels.",
)
