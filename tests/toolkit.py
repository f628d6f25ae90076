"""The CUDA toolkit a test's builds use, said by the test instead of left to the machine.

The builder takes nvcc from CUDA_HOME (else from PATH, else /usr/local/cuda), and refuses
an nvcc whose CUDA major version differs from torch's (build.cuda_mismatch, tested in
test_buildcache.py). A test that runs `fix`, `build` or `demo` for what they do with the
build, not for the choice of toolkit, gives its processes one of these environments, so it
holds whichever nvcc the machine has, or none:

- `NO_TOOLKIT`: CUDA_HOME names a folder without nvcc, so the build is the CPU-only one
  (the kernels' .cpp alone), with a CPU torch and a CUDA torch alike;
- `matching_toolkit()`: the machine's toolkit where it can build for this torch (a CUDA
  torch and an nvcc of the same major version: the CUDA build), else `NO_TOOLKIT`.
"""

from __future__ import annotations

from pathlib import Path

# Never created: the builder reports "CUDA_HOME=... has no bin/nvcc" and builds for the CPU.
NO_CUDA_HOME = Path(__file__).resolve().parent / "no-cuda-toolkit"
NO_TOOLKIT = {"CUDA_HOME": str(NO_CUDA_HOME)}


def matching_toolkit() -> dict[str, str]:
    """CUDA_HOME for the machine's toolkit when it matches torch's CUDA, else NO_TOOLKIT."""
    import torch

    from qwen_kvprep.probe.toolchain import nvcc_info

    if not torch.version.cuda:
        return dict(NO_TOOLKIT)
    info, _ = nvcc_info()
    if info is None or info.release[0] != int(str(torch.version.cuda).split(".")[0]):
        return dict(NO_TOOLKIT)
    return {"CUDA_HOME": str(info.cuda_home)}
