# JIT build of the KV-cache extension, as Qwen v1 checkpoints ship it (written for
# qwen-kvprep from the description of the original's behaviour, including its flaws:
# everything happens at import time, the arch list is derived from nvcc's version alone,
# and the source paths are relative to the process's working directory).
import os
import pathlib
import subprocess

from torch.utils import cpp_extension


def _nvcc_release(cuda_home):
    # `nvcc -V` ends with "... release 12.4, V12.4.131"; keep the major and the first
    # digit of the minor only.
    out = subprocess.check_output([cuda_home + "/bin/nvcc", "-V"], universal_newlines=True)
    words = out.split()
    release = words[words.index("release") + 1].split(".")
    return out, release[0], release[1][0]


_here = pathlib.Path(__file__).parent.absolute()
_build_dir = _here / "build"
os.makedirs(_build_dir, exist_ok=True)

_raw, _major, _minor = _nvcc_release(cpp_extension.CUDA_HOME)
_arch_flags = ["-gencode", "arch=compute_70,code=sm_70"]
if int(_major) >= 11:
    _arch_flags += ["-gencode", "arch=compute_80,code=sm_80"]
if int(_minor) >= 7:
    _arch_flags += ["-gencode", "arch=compute_90,code=sm_90"]

cache_autogptq_cuda_256 = cpp_extension.load(
    name="cache_autogptq_cuda_256",
    sources=["./cache_autogptq_cuda_256.cpp", "./cache_autogptq_cuda_kernel_256.cu"],
    build_directory=str(_build_dir),
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"] + _arch_flags + ["--use_fast_math"],
    verbose=1,
)
