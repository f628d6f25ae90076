"""The ABI-relevant facts of this machine a build depends on: torch, the CUDA compiler and
the architectures it accepts (the Python tag and platform are in common)."""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep.common import build_cuda_home


@dataclass(frozen=True)
class TorchInfo:
    version: str  # full torch.__version__, "+cu130" tag included
    cuda: Optional[str]  # torch.version.cuda; None for a CPU build
    cxx11_abi: bool
    # The C++ standard torch's extension builder compiles with, and its headers need.
    cxx_std: str = "c++17"

    @property
    def cuda_major(self) -> Optional[int]:
        return int(self.cuda.split(".")[0]) if self.cuda else None


# torch >= 2.12 compiles extensions as C++20 (its headers use <compare>, e.g.
# std::strong_ordering); 2.0 up to 2.11 as C++17.
_CXX20_SINCE = (2, 12)
# How torch.utils.cpp_extension spells the standard in the flags it gives a compile.
_STD_FLAG = re.compile(r"['\"]-std=(c\+\+\d\d)['\"]")


def cxx_standard(torch_version: str, cpp_extension_source: Optional[str] = None) -> str:
    """The `-std=` value torch's extension builder uses: read from its own source when its
    code names one standard (so a future torch that moves on is followed; the examples in
    its docstrings, `>>>`/`...` lines, do not count), else from the version."""
    if cpp_extension_source:
        found: set[str] = {
            std
            for line in cpp_extension_source.splitlines()
            if not line.lstrip().startswith((">>>", "..."))
            for std in _STD_FLAG.findall(line)
        }
        if len(found) == 1:
            return found.pop()
    m = re.match(r"(\d+)\.(\d+)", torch_version)
    if m and (int(m.group(1)), int(m.group(2))) >= _CXX20_SINCE:
        return "c++20"
    return "c++17"


def _cpp_extension_source() -> Optional[str]:
    """The text of torch.utils.cpp_extension, found without importing it: its import
    resolves a CUDA home of its own (and logs "No CUDA runtime is found, using
    CUDA_HOME=..." without a GPU), which need not be the toolkit the build uses."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch.utils.cpp_extension")
        source = spec.origin if spec is not None else None
        if not source:
            return None
        with open(source, encoding="utf-8") as fh:
            return fh.read(1 << 20)
    except (ImportError, ValueError, OSError, UnicodeDecodeError):
        return None


def torch_info() -> TorchInfo:
    """Facts of the installed torch (imports it: a build needs it anyway)."""
    import torch

    version = str(torch.__version__)
    return TorchInfo(
        version=version,
        cuda=torch.version.cuda,
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        cxx_std=cxx_standard(version, _cpp_extension_source()),
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
    found, how = build_cuda_home()
    if found is None:
        return None, how
    home = Path(found)
    nvcc = home / "bin" / "nvcc"
    try:
        st = nvcc.stat()
        version, arches = _probe_nvcc(str(nvcc), (st.st_mtime_ns, st.st_size))
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return None, f"{nvcc} does not run ({exc})"
    return NvccInfo(home, nvcc, version, arches), how
