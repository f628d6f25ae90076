"""Turn a compiler log into the few lines that matter and a concrete suggestion.

A failed torch extension build ends in a Python traceback ("Error building extension")
that says nothing; the cause is a few `error:` lines buried in thousands of lines of
warnings and command lines.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_ERROR = re.compile(
    r"(\berror\b\s*:|\bnvcc fatal\b|undefined reference|cannot find -l|"
    r"mismatches the version that was used to compile PyTorch|Ninja is required|"
    r"\bundefined symbol\b|internal compiler error|\bKilled\b)",
    re.IGNORECASE,
)
# Lines that contain "error" but only report that something else failed.
_NOISE = re.compile(
    r"(ninja: build stopped|Error building extension|CalledProcessError|"
    r"collect2: error: ld returned|^\s*raise |^Traceback|^FAILED: |error: command .* failed)",
    re.IGNORECASE,
)

# (what the log says, case ignored; what to do), the most specific first
_ADVICE_TEXT: Sequence[tuple[str, str]] = [
    (
        r"unsupported GNU version|unsupported clang version",
        "this nvcc does not support the host compiler: install a gcc/g++ it supports and "
        "point nvcc at it, e.g. `export NVCC_PREPEND_FLAGS='-ccbin /usr/bin/g++-12'`, "
        "or use a newer CUDA toolkit",
    ),
    (
        r"Python\.h: No such file",
        "the Python headers are missing: install them (Debian/Ubuntu: "
        "`apt-get install python3-dev` for this Python's version; RHEL: python3-devel)",
    ),
    (
        r"mismatches the version that was used to compile PyTorch",
        "nvcc and torch were built for different CUDA major versions: install the CUDA "
        "toolkit matching torch.version.cuda (and set CUDA_HOME to it), or a torch wheel "
        "built for your toolkit",
    ),
    (
        r"Unsupported gpu architecture",
        "nvcc does not know an architecture it was asked for: pass --arch (or "
        "TORCH_CUDA_ARCH_LIST) with architectures from `nvcc --list-gpu-arch`",
    ),
    (
        r"Ninja is required",
        "install ninja into this environment: `pip install ninja`",
    ),
    (
        r"(cuda_runtime\.h|cuda_fp16\.h|cuda\.h): No such file",
        "the CUDA headers were not found: set CUDA_HOME to the toolkit that holds nvcc "
        "(the folder with bin/nvcc and include/cuda_runtime.h)",
    ),
    (
        r"internal compiler error: Killed|\bKilled\b|signal 9",
        "a compiler was killed, most likely out of memory: build with fewer parallel jobs "
        "(`MAX_JOBS=1`)",
    ),
    (
        r"DeprecatedTypeProperties",
        "these kernel sources use an API that current torch removed (the official Qwen "
        "sources do): build qwen-kvprep's own kernels (the default source)",
    ),
    (
        r"undefined symbol",
        "the extension does not link against this torch: rebuild with --force; if it "
        "persists, torch and its headers come from different installations",
    ),
]
_ADVICE = [(re.compile(pattern, re.IGNORECASE), hint) for pattern, hint in _ADVICE_TEXT]


def first_errors(log: str, limit: int = 5) -> list[str]:
    """The first distinct real error lines of a build log."""
    out: list[str] = []
    for line in log.splitlines():
        text = line.strip()
        if not text or _NOISE.search(text) or not _ERROR.search(text):
            continue
        if len(text) > 300:
            text = text[:297] + "..."
        if text not in out:
            out.append(text)
        if len(out) >= limit:
            break
    return out


def advice(log: str) -> list[str]:
    """Suggestions for the causes recognised in the log (most specific first)."""
    return [hint for pattern, hint in _ADVICE if pattern.search(log)]
