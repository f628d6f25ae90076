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

_ADVICE: Sequence[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"unsupported GNU version|unsupported clang version", re.IGNORECASE),
        "this nvcc does not support the host compiler: install a gcc/g++ it supports and "
        "point nvcc at it, e.g. `export NVCC_PREPEND_FLAGS='-ccbin /usr/bin/g++-12'`, "
        "or use a newer CUDA toolkit",
    ),
    (
        re.compile(r"Python\.h: No such file", re.IGNORECASE),
        "the Python headers are missing: install them (Debian/Ubuntu: "
        "`apt-get install python3-dev` for this Python's version; RHEL: python3-devel)",
    ),
    (
        re.compile(r"mismatches the version that was used to compile PyTorch"),
        "nvcc and torch were built for different CUDA major versions: install the CUDA "
        "toolkit matching torch.version.cuda (and set CUDA_HOME to it), or a torch wheel "
        "built for your toolkit",
    ),
    (
        re.compile(r"Unsupported gpu architecture", re.IGNORECASE),
        "nvcc does not know an architecture it was asked for: pass --arch (or "
        "TORCH_CUDA_ARCH_LIST) with architectures from `nvcc --list-gpu-arch`",
    ),
    (
        re.compile(r"Ninja is required", re.IGNORECASE),
        "install ninja into this environment: `pip install ninja`",
    ),
    (
        re.compile(r"(cuda_runtime\.h|cuda_fp16\.h|cuda\.h): No such file", re.IGNORECASE),
        "the CUDA headers were not found: set CUDA_HOME to the toolkit that holds nvcc "
        "(the folder with bin/nvcc and include/cuda_runtime.h)",
    ),
    (
        re.compile(r"internal compiler error: Killed|\bKilled\b|signal 9", re.IGNORECASE),
        "a compiler was killed, most likely out of memory: build with fewer parallel jobs "
        "(`MAX_JOBS=1`)",
    ),
    (
        re.compile(r"DeprecatedTypeProperties", re.IGNORECASE),
        "these kernel sources use an API that current torch removed (the official Qwen "
        "sources do): build qwen-kvprep's own kernels (the default source)",
    ),
    (
        re.compile(r"undefined symbol", re.IGNORECASE),
        "the extension does not link against this torch: rebuild with --force; if it "
        "persists, torch and its headers come from different installations",
    ),
]


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
