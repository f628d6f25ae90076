"""The ABI-relevant facts of this machine: torch, Python, platform, CUDA toolkit.

`python_tag()` and `machine()` are repeated verbatim in templates/cpp_kernels.py.tmpl (the
loader must not need qwen-kvprep installed); tests check both give the same answer.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


def python_tag() -> str:
    # "cp311", "cp313t": the interpreter and its ABI flags (debug, free-threaded) are
    # what an extension module is bound to.
    impl = "cp" if sys.implementation.name == "cpython" else sys.implementation.name
    return f"{impl}{sys.version_info[0]}{sys.version_info[1]}{getattr(sys, 'abiflags', '')}"


def machine() -> str:
    # "linux-x86_64", "linux-aarch64", "macosx-14.0-arm64": OS and CPU architecture.
    return sysconfig.get_platform()


@dataclass(frozen=True)
class TorchInfo:
    version: str  # full torch.__version__, "+cu130" tag included
    cuda: Optional[str]  # torch.version.cuda; None for a CPU build
    cxx11_abi: bool

    @property
    def cuda_major(self) -> Optional[int]:
        return int(self.cuda.split(".")[0]) if self.cuda else None


def torch_info() -> TorchInfo:
    """Facts of the installed torch (imports it: a build needs it anyway)."""
    import torch

    return TorchInfo(
        version=str(torch.__version__),
        cuda=torch.version.cuda,
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    )


@dataclass(frozen=True)
class NvccInfo:
    cuda_home: Path
    nvcc: Path
    version: str  # "13.0.88"
    arches: tuple[str, ...]  # what `nvcc --list-gpu-arch` accepts, as "7.5", "12.1", ...

    @property
    def release(self) -> tuple[int, int]:
        major, minor = self.version.split(".")[:2]
        return int(major), int(minor)


def find_cuda_home() -> tuple[Optional[Path], str]:
    """The CUDA toolkit to build with, and how it was found (or why none was).

    CUDA_HOME / CUDA_PATH win, as in torch. Otherwise nvcc on PATH is followed through
    symlinks, and a wrapper script that is not inside a toolkit (/usr/local/bin/nvcc exec'ing
    the real one) falls through to /usr/local/cuda: torch would take /usr/local as CUDA_HOME
    there and fail to find cuda_runtime.h.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            home = Path(value)
            if (home / "bin" / "nvcc").exists():
                return home, f"{var}={value}"
            return None, f"{var}={value} has no bin/nvcc"
    on_path = shutil.which("nvcc")
    if on_path:
        home = Path(os.path.realpath(on_path)).parent.parent
        if (home / "include" / "cuda_runtime.h").exists():
            return home, f"nvcc on PATH ({on_path})"
    default = Path("/usr/local/cuda")
    if (default / "bin" / "nvcc").exists():
        return default, "/usr/local/cuda"
    if on_path:
        return None, f"nvcc on PATH ({on_path}) is not inside a CUDA toolkit; set CUDA_HOME"
    return None, "no nvcc: CUDA_HOME is unset, nvcc is not on PATH, no /usr/local/cuda"


_RELEASE = re.compile(r"release (\d+)\.(\d+), V(\d+(?:\.\d+)+)")
_ARCH = re.compile(r"^compute_(\d+)(\d)$")


def arch_of_compute(name: str) -> Optional[str]:
    """ "compute_121" -> "12.1"; variants with a suffix ("compute_90a") -> None."""
    m = _ARCH.match(name.strip())
    return f"{int(m.group(1))}.{m.group(2)}" if m else None


# Architectures of nvcc releases that predate --list-gpu-arch (added in CUDA 11.0 era
# toolkits; kept for odd installations). Only what qwen-kvprep would target (>= 7.0).
_FALLBACK_ARCHES = {
    10: ("7.0", "7.2", "7.5"),
    11: ("7.0", "7.2", "7.5", "8.0", "8.6"),
}


@functools.lru_cache(maxsize=8)
def _probe_nvcc(nvcc: str, stamp: tuple[int, int]) -> tuple[str, tuple[str, ...]]:
    # `stamp` (mtime, size) is only part of the cache key: a replaced nvcc is re-probed.
    del stamp
    out = subprocess.run(
        [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    m = _RELEASE.search(out)
    if not m:
        raise ValueError(f"unrecognised `nvcc --version` output: {out.strip()[-200:]!r}")
    version = m.group(3)
    arches: tuple[str, ...] = ()
    listed = subprocess.run(
        [nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60, check=False
    )
    if listed.returncode == 0:
        found = [arch_of_compute(line) for line in listed.stdout.split()]
        arches = tuple(sorted({a for a in found if a}, key=arch_sort_key))
    if not arches:
        arches = _FALLBACK_ARCHES.get(int(version.split(".")[0]), ())
    return version, arches


def arch_sort_key(arch: str) -> tuple[int, int]:
    major, minor = arch.split("+")[0].rstrip("af").split(".")
    return int(major), int(minor)


def nvcc_info() -> tuple[Optional[NvccInfo], str]:
    """The CUDA compiler, or None and the reason (said plainly in the build.mode finding)."""
    home, how = find_cuda_home()
    if home is None:
        return None, how
    nvcc = home / "bin" / "nvcc"
    try:
        st = nvcc.stat()
        version, arches = _probe_nvcc(str(nvcc), (st.st_mtime_ns, st.st_size))
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return None, f"{nvcc} does not run ({exc})"
    return NvccInfo(home, nvcc, version, arches), how
