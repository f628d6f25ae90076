"""Which GPU architectures a CUDA build targets.

Order of precedence: --arch, TORCH_CUDA_ARCH_LIST, the visible GPUs, else a default that
covers every architecture the installed nvcc supports. No GPU is needed to build.

The default relies on CUDA's binary compatibility: a cubin for X.y runs on every X.z with
z >= y, so one cubin per major (its lowest minor that nvcc knows) covers the whole family
(8.0 runs on 8.6/8.7/8.9, 10.0 on 10.3, 12.0 on 12.1). PTX for the newest family lets the
driver JIT the kernels for GPUs newer than this nvcc. This keeps a cold all-architecture
build to a handful of device passes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Optional

from qwen_kvprep.common import ARCH_LIST_FIX, read_arch_list
from qwen_kvprep.errors import BuildError, UsageError
from qwen_kvprep.probe.toolchain import NvccInfo, arch_sort_key

ENV_ARCH = "TORCH_CUDA_ARCH_LIST"

# Kernels use nothing older than Volta; CUDA 13 dropped Volta itself (nvcc's list says so).
MIN_ARCH = (7, 0)


def parse_arch_list(text: str, origin: str) -> tuple[str, ...]:
    """ "8.0;9.0+PTX", "8.0 9.0", "sm_90a" -> ("8.0", "9.0+PTX", "9.0a"). Sorted, unique.
    A usage error for anything else (common.read_arch_list holds the grammar)."""
    try:
        return read_arch_list(text, origin)
    except ValueError as exc:
        raise UsageError(str(exc), fix=ARCH_LIST_FIX) from None


def family_default(supported: Sequence[str]) -> tuple[str, ...]:
    """One cubin per major version (its lowest supported minor) and PTX for the newest."""
    lowest: dict[int, tuple[int, int]] = {}
    for arch in supported:
        major, minor = arch_sort_key(arch)
        if (major, minor) < MIN_ARCH:
            continue
        if major not in lowest or minor < lowest[major][1]:
            lowest[major] = (major, minor)
    picked = [f"{a}.{b}" for a, b in sorted(lowest.values())]
    if picked:
        picked[-1] += "+PTX"
    return tuple(picked)


def covers(arch_list: Iterable[str], capability: tuple[int, int]) -> bool:
    """Whether a build for `arch_list` runs on a GPU of `capability` (major, minor)."""
    for entry in arch_list:
        base = entry.split("+")[0]
        major, minor = arch_sort_key(base)
        if base[-1] in "af":
            # arch-specific cubins run on that exact architecture only
            if (major, minor) == capability:
                return True
            continue
        if major == capability[0] and minor <= capability[1]:
            return True
        if entry.endswith("+PTX") and (major, minor) <= capability:
            return True
    return False


def visible_gpu_archs() -> tuple[str, ...]:
    """Compute capabilities of the GPUs this process can see (empty without any)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return ()
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    except Exception:  # no driver, broken driver: building needs no GPU anyway
        return ()
    return tuple(f"{a}.{b}" for a, b in sorted(caps))


def gencode_flags(arch_list: Sequence[str]) -> list[str]:
    flags: list[str] = []
    for entry in arch_list:
        base = entry.split("+")[0]
        num = base.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if entry.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def choose_arch_list(option: Optional[str], nvcc: NvccInfo) -> tuple[tuple[str, ...], str]:
    """The architectures to build for and where that choice came from."""
    env = os.environ.get(ENV_ARCH, "").strip()
    if option:
        arch_list, origin = parse_arch_list(option, "--arch"), "--arch"
    elif env and env.lower() != "native":
        arch_list, origin = parse_arch_list(env, ENV_ARCH), ENV_ARCH
    else:
        visible = visible_gpu_archs()
        if visible:
            arch_list, origin = visible, "the visible GPU(s)"
        else:
            arch_list = family_default(nvcc.arches)
            origin = (
                f"default: covers every architecture nvcc {nvcc.version} supports "
                f"({', '.join(a for a in nvcc.arches if arch_sort_key(a) >= MIN_ARCH)})"
            )
    unsupported = [a for a in arch_list if a.split("+")[0].rstrip("af") not in nvcc.arches]
    if unsupported:
        message = (
            f"nvcc {nvcc.version} cannot compile for {', '.join(unsupported)} "
            f"(asked by {origin}); it supports {', '.join(nvcc.arches)}"
        )
        fix = (
            "drop those architectures from --arch / TORCH_CUDA_ARCH_LIST, or install a CUDA "
            "toolkit that supports them (CUDA 13 dropped Volta 7.0/7.2; use CUDA 12.x for those)"
        )
        raise BuildError.failing("build.arch", message, fix)
    return arch_list, origin
