"""Environment checks: Python, torch, GPU, driver, CUDA toolchain, transformers and the
packages the Qwen remote code needs.

Toolchain findings (CUDA_HOME, nvcc, host compiler, ninja, Python headers) matter only
for building the extension: when a build for this torch already sits in the build cache,
a toolchain problem is a warning (the next rebuild would fail), not a failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional

from qwen_kvprep.checks.kernels import kernel_requested
from qwen_kvprep.checks.measured import FIRST_WORKING, tokenizer_failure
from qwen_kvprep.checks.registry import CUDA_TORCH, ENV, GIVEN_CHECKPOINT, TORCH, check, env_of
from qwen_kvprep.checks.verdicts import fail, info, ok, skip, warn
from qwen_kvprep.common import gptq_install
from qwen_kvprep.findings import Finding, FindingsLike
from qwen_kvprep.probe.binary import parse_arch_label, runs_on
from qwen_kvprep.probe.caches import serving_builds
from qwen_kvprep.probe.env import EnvFacts, version_tuple
from qwen_kvprep.probe.facts import Facts

if TYPE_CHECKING:
    from qwen_kvprep.jsontypes import JSON

MIN_CUDA = (11, 4)
TRANSFORMERS_MIN = (4, 32)
TRANSFORMERS_FIRST_BROKEN = (4, 54)  # measured: 4.53.3 works, 4.54.1 does not
TRANSFORMERS_QWEN_PIN = (4, 38)
TRANSFORMERS_PIN_FIX = 'pip install -U "transformers>=4.32"'
# What Qwen's code needs once fix has run (transformers_stream_generator, which only
# chat_stream imports, is not: the compatibility module streams without it).
REMOTE_REQUIREMENTS = ("tiktoken", "einops")
CUDA_TORCH_FIX = (
    "install a torch built for CUDA >= 11.8, e.g. "
    "`pip install torch --index-url https://download.pytorch.org/whl/cu121`"
)

# Newest gcc major that nvcc's crt/host_config.h accepts, by nvcc release (first entry
# <= the release applies). Used only when the toolkit's own host_config.h cannot be read
# (the probe parses it; that file is the authority). Sources: the CUDA installation
# guides' host compiler tables; 13.0 (gcc <= 15) confirmed from its host_config.h here.
# 11.4.0 (V11.4.48) stopped at gcc 10; 11.4 Update 1 added gcc 11.
_MAX_GCC: tuple[tuple[tuple[int, int], int], ...] = (
    ((11, 0), 10),
    ((11, 1), 10),
    ((11, 4), 11),
    ((12, 0), 12),
    ((12, 4), 13),
    ((12, 8), 14),
    ((13, 0), 15),
)
# torch 2.x headers are C++17: older gcc releases fail on them.
_MIN_GCC = 9

# Linux driver each CUDA runtime needs for full support (CUDA release notes, "CUDA
# Toolkit and Corresponding Driver Versions", GA releases), and the minimum with which a
# newer minor of the same major still runs through minor-version compatibility.
_DRIVER_FULL: dict[tuple[int, int], str] = {
    (11, 4): "470.42.01",
    (11, 5): "495.29.05",
    (11, 6): "510.39.01",
    (11, 7): "515.43.04",
    (11, 8): "520.61.05",
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
}
_DRIVER_MINOR_COMPAT: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

# Oldest GPU an nvcc major can still compile for (CUDA 12 dropped Kepler, CUDA 13 dropped
# Maxwell, Pascal and Volta), and the first nvcc that knows each newer GPU.
_NVCC_MIN_TARGET: dict[int, tuple[int, int]] = {11: (3, 5), 12: (5, 0), 13: (7, 5)}
_NVCC_FIRST_FOR: dict[tuple[int, int], tuple[int, int]] = {
    (8, 6): (11, 1),
    (8, 7): (11, 4),
    (8, 9): (11, 8),
    (9, 0): (11, 8),
    (10, 0): (12, 8),
    (10, 1): (12, 8),
    (12, 0): (12, 8),
    (10, 3): (12, 9),
    (12, 1): (12, 9),
    (11, 0): (13, 0),
}
# The Int8 KV kernel targets Volta and newer (buildcache/arch.py MIN_ARCH).
_KERNEL_MIN_CC = (7, 0)


def _v(text: Optional[str], n: int = 2) -> Optional[tuple[int, ...]]:
    t = version_tuple(text)
    if t is None:
        return None
    return (t + (0,) * n)[:n]


def _vs(t: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in t)


def max_gcc_for(nvcc: tuple[int, ...], build: Optional[str] = None) -> Optional[int]:
    if build == "V11.4.48":
        return 10
    best: Optional[int] = None
    for since, gcc in _MAX_GCC:
        if tuple(nvcc[:2]) >= since:
            best = gcc
    return best


def _build_present(facts: Facts) -> Optional[str]:
    """A build for this torch (and the checkpoint's kernel sources) that the loader can use."""
    cp = facts.checkpoint
    builds = serving_builds(facts.caches, facts.env, getattr(cp, "kernel_sources", None))
    return builds[0].dir if builds else None


def _why_no_build_is_needed(facts: Facts) -> Optional[str]:
    """Why a server started now compiles nothing, so that a toolchain problem is no failure
    (doctor's exit code: docs/reference.md); None when it must compile: no cached build
    serves it, or the checkpoint's config asks for the kernel through Qwen's original
    cpp_kernels.py, which compiles at every load."""
    cp = facts.checkpoint
    if cp is not None and not kernel_requested(facts):
        return (
            "only a build needs this, and a server started now builds nothing: config.json "
            "does not ask for the kernel"
        )
    if cp is not None and not getattr(cp, "loader_is_ours", False):
        return None
    present = _build_present(facts)
    if present:
        return f"only a rebuild needs this: a build for this torch exists in {present}"
    return None


def _toolchain_finding(
    facts: Facts, message: str, fix: Optional[str], details: Mapping[str, object]
) -> Finding:
    why = _why_no_build_is_needed(facts)
    if why is not None:
        return warn(f"{message} ({why})", fix, details=details)
    return fail(message, fix, details=details)


# ---------------------------------------------------------------------------------------


@check("env.python", "Python version", needs=(ENV,))
def python_version(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    v = _v(env.python_version)
    details = {"version": env.python_version, "executable": env.python_executable}
    if v is not None and v < (3, 9):
        return fail(
            f"Python {env.python_version} is too old: qwen-kvprep and the torch releases it "
            "supports need Python >= 3.9",
            "use Python 3.9 or newer",
            details=details,
        )
    return ok(
        f"Python {env.python_version} ({env.python_executable})", details=details
    )


@check("env.torch", "torch importable and built for a usable CUDA", needs=(ENV,))
def torch_build(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    details = {"torch": env.torch_version, "torch_cuda": env.torch_cuda, "error": env.torch_error}
    if env.torch_version is None:
        return fail(
            f"torch is not importable ({env.torch_error or 'not installed'}), so the model "
            "cannot load and the kernel cannot be built",
            "pip install torch (for a GPU a CUDA build, e.g. "
            "`pip install torch --index-url https://download.pytorch.org/whl/cu121`)",
            details=details,
        )
    if env.torch_hip:
        return warn(
            f"torch {env.torch_version} is a ROCm build (HIP {env.torch_hip}): the Int8 KV "
            "kernel is CUDA code, so only its CPU path can be used",
            CUDA_TORCH_FIX,
            details=details,
        )
    if env.torch_cuda is None:
        return info(
            f"torch {env.torch_version} is a CPU build: CPU kernel path only (the GPU kernel "
            "needs a CUDA build of torch)",
            details=details,
        )
    cuda = _v(env.torch_cuda)
    if cuda is not None and cuda < MIN_CUDA:
        return fail(
            f"torch {env.torch_version} is built for CUDA {env.torch_cuda}, older than the "
            f"{_vs(MIN_CUDA)} the kernel build needs",
            CUDA_TORCH_FIX,
            details=details,
        )
    tv = _v(env.torch_version)
    if tv is not None and tv < (2, 0):
        return warn(
            f"torch {env.torch_version} is older than 2.0, which qwen-kvprep is not tested with",
            "pip install 'torch>=2.0'",
            details=details,
        )
    return ok(
        f"torch {env.torch_version} built for CUDA {env.torch_cuda}", details=details
    )


@check("env.gpu", "GPUs visible to torch and their compute capability", needs=(ENV,))
def gpu(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    labels = [g.label for g in env.gpus]
    details: dict[str, object] = {
        "gpus": labels,
        "source": env.gpu_source,
        "CUDA_VISIBLE_DEVICES": env.env_vars.get("CUDA_VISIBLE_DEVICES"),
    }
    if env.torch_version is None:
        if env.gpus:
            return info(
                f"GPU(s) present: {', '.join(labels)} (torch is not importable)",
                details=details,
            )
        return skip("torch is not importable (see env.torch)", details=details)
    if env.torch_cuda is None:
        if env.gpus:
            return warn(
                f"GPU(s) present ({', '.join(labels)}) but torch is a CPU build, so the model "
                "and the kernel run on the CPU",
                CUDA_TORCH_FIX,
                details=details,
            )
        return info("no GPU (and torch is a CPU build)", details=details)
    if not env.gpus:
        if env.gpu_error:
            return warn(
                f"torch found no usable GPU: {env.gpu_error}",
                "check the NVIDIA driver (env.driver) and CUDA_VISIBLE_DEVICES",
                details=details,
            )
        return info(
            "no GPU visible: the kernel can be built here (no GPU needed) but runs only "
            "where a GPU is",
            details=details,
        )
    out: list[Finding] = []
    torch_code = [e for e in (parse_arch_label(a) for a in env.torch_arch_flags) if e]
    for g in env.gpus:
        d = dict(details, gpu=g.label)
        if g.capability < _KERNEL_MIN_CC:
            out.append(
                fail(
                    f"GPU {g.index} {g.label} is older than Volta: the Int8 KV kernel is built "
                    "for compute capability 7.0 and newer, so it cannot run there",
                    "run the model on a GPU of compute capability >= 7.0",
                    details=d,
                )
            )
        elif torch_code and runs_on(torch_code, g.capability) is None:
            out.append(
                fail(
                    f"torch {env.torch_version} carries no code for GPU {g.index} {g.label} "
                    f"(only {' '.join(env.torch_arch_flags)}), so every CUDA op fails with "
                    "`no kernel image is available for execution on the device`",
                    "install a torch built for a CUDA release that supports this GPU",
                    details=d,
                )
            )
        else:
            out.append(ok(f"GPU {g.index}: {g.label}", details=d))
    return out


def _driver_at_least(driver: str, minimum: str) -> bool:
    a, b = version_tuple(driver), version_tuple(minimum)
    return a is not None and b is not None and a >= b


def _full_driver_for(cuda: tuple[int, ...]) -> Optional[str]:
    best = None
    for (major, minor), drv in sorted(_DRIVER_FULL.items()):
        if major == cuda[0] and (major, minor) <= cuda[:2]:
            best = drv
    return best


@check("env.driver", "NVIDIA driver new enough for torch's CUDA runtime", needs=(ENV,))
def driver(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    if env.torch_version is None or env.torch_cuda is None:
        if env.driver_version:
            return info(
                f"NVIDIA driver {env.driver_version} (not used: no CUDA build of torch)",
            )
        return skip("not needed: no CUDA build of torch")
    need = _v(env.torch_cuda)
    details = {
        "driver": env.driver_version,
        "driver_cuda": env.driver_cuda,
        "torch_cuda": env.torch_cuda,
    }
    if need is None:
        return skip(
            f"unrecognised torch CUDA version {env.torch_cuda!r}", details=details
        )
    full = _full_driver_for(need)
    compat = _DRIVER_MINOR_COMPAT.get(need[0])
    target = full or compat or f"the release for CUDA {env.torch_cuda}"
    upgrade = f"update the NVIDIA driver to >= {target}, or install a torch built for an older CUDA"
    have = _v(env.driver_cuda)
    if have is None and env.driver_version is None:
        if env.gpus:
            return ok(
                "the driver runs the visible GPUs (its version could not be read)",
                details=details,
            )
        return info("no NVIDIA driver found (no GPU here)", details=details)
    too_old = (
        f"the NVIDIA driver ({env.driver_version or 'CUDA ' + str(env.driver_cuda)}) is too old "
        f"for torch's CUDA {env.torch_cuda} runtime: CUDA fails to initialise with `CUDA driver "
        "version is insufficient for CUDA runtime version`"
    )
    if have is not None:
        if have >= need[:2]:
            return ok(
                f"NVIDIA driver {env.driver_version or '(version unknown)'} supports "
                f"CUDA {env.driver_cuda}",
                details=details,
            )
        if have[0] == need[0] and (
            env.driver_version is None or (compat and _driver_at_least(env.driver_version, compat))
        ):
            return warn(
                f"the driver supports CUDA {env.driver_cuda}, older than torch's "
                f"{env.torch_cuda}: it runs through minor-version compatibility, but PTX "
                "newer than the driver cannot be JIT-compiled",
                upgrade,
                details=details,
            )
        return fail(too_old, upgrade, details=details)
    assert env.driver_version is not None
    if full and _driver_at_least(env.driver_version, full):
        return ok(
            f"NVIDIA driver {env.driver_version} supports CUDA {env.torch_cuda}",
            details=details,
        )
    if compat and _driver_at_least(env.driver_version, compat):
        return warn(
            f"NVIDIA driver {env.driver_version} predates CUDA {env.torch_cuda} ({full} or "
            "newer): it runs through minor-version compatibility, but PTX newer than the "
            "driver cannot be JIT-compiled",
            upgrade,
            details=details,
        )
    return fail(too_old, upgrade, details=details)


def _cuda_home_fix(env: EnvFacts) -> str:
    major = (_v(env.torch_cuda) or (0,))[0]
    matching = [c for c in env.cuda_candidates if f"-{major}." in c] or list(env.cuda_candidates)
    if matching:
        return f"export CUDA_HOME={matching[0]}"
    ver = env.torch_cuda or "X.Y"
    return f"install the CUDA {ver} toolkit and `export CUDA_HOME=/usr/local/cuda-{ver}`"


@check("env.cuda_home", "CUDA_HOME as torch resolves it", needs=(ENV, TORCH, CUDA_TORCH))
def cuda_home(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    details = {
        "cuda_home": env.cuda_home,
        "source": env.cuda_home_source,
        "CUDA_HOME": env.cuda_home_env,
        "CUDA_PATH": env.cuda_path_env,
        "nvcc_on_path": env.nvcc_on_path,
        "lib_dir": env.cuda_lib_dir,
        "candidates": list(env.cuda_candidates),
    }
    fix = _cuda_home_fix(env)
    raw = env.cuda_home_env if env.cuda_home_source == "CUDA_HOME" else env.cuda_path_env
    list_sep = ";" if env.platform.startswith("win") else ":"
    if env.cuda_home_source in ("CUDA_HOME", "CUDA_PATH") and raw and list_sep in raw:
        return _toolchain_finding(
            facts,
            f"{env.cuda_home_source}={raw!r} is a path list, but torch uses it as one folder, "
            f"so `{raw}/bin/nvcc` does not exist and every CUDA build fails",
            fix,
            details=details,
        )
    if env.cuda_home is None:
        return _toolchain_finding(
            facts,
            "CUDA_HOME is unset and no nvcc was found, so no CUDA build is possible (torch: "
            "`CUDA_HOME environment variable is not set`; Qwen's own cpp_kernels.py: "
            '`TypeError` on `CUDA_HOME + "/bin/nvcc"`)',
            fix,
            details=details,
        )
    if env.nvcc_path is None:
        return _toolchain_finding(
            facts,
            f"CUDA_HOME resolves to {env.cuda_home} (from {env.cuda_home_source}), which has "
            f"no bin/nvcc: torch stops with `nvcc not found at '{env.cuda_home}/bin/nvcc'`",
            fix,
            details=details,
        )
    if env.cudart_found is False:
        where = (
            f"torch takes {env.cuda_home} because `nvcc` sits in {env.nvcc_on_path}"
            if env.cuda_home_source == "nvcc-on-path"
            else f"CUDA_HOME resolves to {env.cuda_home} (from {env.cuda_home_source})"
        )
        message = (
            f"{where}, which holds no CUDA libraries ({env.cuda_lib_dir} has no libcudart): "
            "linking fails with `cannot find -lcudart`"
        )
        if env.cuda_home_source == "nvcc-on-path" and env.cuda_candidates:
            # qwen-kvprep's builder steps over such a wrapper to a complete toolkit; torch's
            # own JIT builds (Qwen's original cpp_kernels.py) do not.
            cp = facts.checkpoint
            if _why_no_build_is_needed(facts) is None and not getattr(cp, "loader_is_ours", True):
                return fail(
                    message + " (Qwen's original cpp_kernels.py builds this way)",
                    fix,
                    details=details,
                )
            return warn(
                message + f"; qwen-kvprep's own build uses {env.cuda_candidates[0]}, "
                "torch's JIT builds do not",
                fix,
                details=details,
            )
        return _toolchain_finding(facts, message, fix, details=details)
    return ok(
        f"CUDA_HOME resolves to {env.cuda_home} (from {env.cuda_home_source})",
        details=details,
    )


@check("env.nvcc", "nvcc version against torch's CUDA and the GPUs", needs=(ENV, TORCH, CUDA_TORCH))
def nvcc(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    details = {"nvcc": env.nvcc_version, "nvcc_path": env.nvcc_path, "torch_cuda": env.torch_cuda}
    fix = _cuda_home_fix(env)
    if env.nvcc_version is None:
        if env.nvcc_error:
            return _toolchain_finding(
                facts, f"nvcc does not run: {env.nvcc_error}", fix, details=details
            )
        return skip("no nvcc found (see env.cuda_home)", details=details)
    nv = _v(env.nvcc_version)
    tc = _v(env.torch_cuda)
    assert nv is not None
    if nv < MIN_CUDA:
        return _toolchain_finding(
            facts,
            f"nvcc {env.nvcc_version} is older than {_vs(MIN_CUDA)}, the oldest CUDA the "
            "kernel builds with",
            fix,
            details=details,
        )
    out: list[Finding] = []
    if tc is not None and nv[0] != tc[0]:
        out.append(
            _toolchain_finding(
                facts,
                f"nvcc {env.nvcc_version} and torch's CUDA {env.torch_cuda} differ in major "
                f"version: torch refuses to build (`The detected CUDA version "
                f"({env.nvcc_version}) mismatches the version that was used to compile "
                f"PyTorch ({env.torch_cuda})`)",
                f"{fix}, or install a torch built for CUDA {nv[0]}.x",
                details=details,
            )
        )
    elif tc is not None and nv != tc:
        out.append(
            warn(
                f"nvcc {env.nvcc_version} differs from torch's CUDA {env.torch_cuda} in the "
                "minor version: torch builds with a warning and the result runs",
                f"for an exact match use the CUDA {env.torch_cuda} toolkit ({fix})",
                details=details,
            )
        )
    for g in env.gpus:
        oldest = _NVCC_MIN_TARGET.get(nv[0])
        first = _NVCC_FIRST_FOR.get(g.capability)
        if oldest is not None and g.capability < oldest:
            out.append(
                _toolchain_finding(
                    facts,
                    f"nvcc {env.nvcc_version} cannot compile for GPU {g.index} {g.label}: "
                    "`nvcc fatal : Unsupported gpu architecture "
                    f"'compute_{g.capability[0]}{g.capability[1]}'`",
                    f"use a CUDA {nv[0] - 1}.x toolkit (and a torch built for it) for this GPU",
                    details=details,
                )
            )
        elif first is not None and nv < first:
            out.append(
                warn(
                    f"nvcc {env.nvcc_version} predates GPU {g.index} {g.label} (needs "
                    f"{_vs(first)}): the kernel can run there only through PTX JIT",
                    f"use a CUDA toolkit >= {_vs(first)}",
                    details=details,
                )
            )
    if not out:
        out.append(
            ok(
                f"nvcc {env.nvcc_version} matches torch's CUDA {env.torch_cuda}",
                details=details,
            )
        )
    return out


@check("env.host_compiler", "C++ compiler present and inside nvcc's supported range", needs=(ENV,))
def host_compiler(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    cxx = env.cxx
    details: dict[str, object] = {
        "cxx": cxx.command if cxx else None,
        "cxx_version": cxx.version if cxx else None,
        "nvcc_host": env.nvcc_host.command if env.nvcc_host else None,
        "nvcc_host_version": env.nvcc_host.version if env.nvcc_host else None,
        "nvcc": env.nvcc_version,
    }
    if cxx is None or cxx.path is None:
        name = cxx.command if cxx else "c++"
        return _toolchain_finding(
            facts,
            f"no C++ compiler: `{name}` is not on PATH, so the extension cannot be built "
            "(torch compiles the .cpp with $CXX or c++)",
            "install one (Debian/Ubuntu: `apt-get install g++`; RHEL: `dnf install gcc-c++`)",
            details=details,
        )
    out: list[Finding] = []
    cv = _v(cxx.version, 1)
    if cxx.kind == "gcc" and cv is not None and cv[0] < _MIN_GCC:
        out.append(
            _toolchain_finding(
                facts,
                f"{cxx.command} is gcc {cxx.version}: torch's headers need C++17, which gcc "
                f"before {_MIN_GCC} does not fully support",
                f"install gcc >= {_MIN_GCC} and `export CXX=g++-N CC=gcc-N`",
                details=details,
            )
        )
    nv = _v(env.nvcc_version)
    host = env.nvcc_host
    if env.torch_is_cuda and nv is not None and host is not None:
        if host.path is None:
            out.append(
                _toolchain_finding(
                    facts,
                    f"nvcc's host compiler `{host.command}` is not on PATH, so the .cu file "
                    "cannot be compiled",
                    f"install gcc/g++ or `export CC={cxx.path}`",
                    details=details,
                )
            )
        else:
            hv = _v(host.version, 1)
            limit = env.nvcc_max_gcc if host.kind == "gcc" else env.nvcc_max_clang
            origin = "its host_config.h"
            if limit is None and host.kind == "gcc":
                limit, origin = max_gcc_for(nv, env.nvcc_build), "the CUDA documentation"
            details.update(max_supported=limit, limit_from=origin)
            if hv is not None and limit is not None and hv[0] > limit:
                word = "GNU" if host.kind == "gcc" else "clang"
                out.append(
                    _toolchain_finding(
                        facts,
                        f"{host.command} is {host.kind} {host.version}, newer than nvcc "
                        f"{env.nvcc_version} supports ({host.kind} <= {limit}, per {origin}): "
                        f"nvcc stops with `unsupported {word} version`",
                        f"install {host.kind} {limit} and `export CC=gcc-{limit} CXX=g++-{limit}` "
                        "(torch hands $CC to nvcc as -ccbin)"
                        if host.kind == "gcc"
                        else f"install clang {limit} and point CC/CXX at it",
                        details=details,
                    )
                )
            elif hv is None or limit is None:
                out.append(
                    info(
                        f"nvcc's host compiler {host.command} ({host.kind} {host.version or '?'}): "
                        f"no known limit for nvcc {env.nvcc_version} to compare with",
                        details=details,
                    )
                )
    if not out:
        extra = ""
        if env.torch_is_cuda and host is not None and host.path and nv is not None:
            extra = f"; nvcc {env.nvcc_version} uses {host.command} ({host.kind} {host.version})"
        out.append(
            ok(
                f"{cxx.command} is {cxx.kind} {cxx.version or '?'}{extra}",
                details=details,
            )
        )
    return out


@check("env.ninja", "ninja on PATH (torch runs it through PATH)", needs=(ENV,))
def ninja(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    details = {
        "ninja": env.ninja_path,
        "version": env.ninja_version,
        "beside_python": env.ninja_beside_python,
    }
    if env.ninja_path:
        return ok(
            f"ninja {env.ninja_version or '?'} at {env.ninja_path}", details=details
        )
    if env.ninja_beside_python:
        folder = env.ninja_beside_python.rsplit("/", 1)[0]
        return _toolchain_finding(
            facts,
            f"ninja is installed in {folder} but that folder is not on PATH, and torch runs "
            "`ninja` through PATH: the build stops with `RuntimeError: Ninja is required to "
            "load C++ extensions`",
            f'export PATH="{folder}:$PATH" (or activate the virtual environment)',
            details=details,
        )
    return _toolchain_finding(
        facts,
        "ninja is not installed: the build stops with `RuntimeError: Ninja is required to "
        "load C++ extensions`",
        "pip install ninja",
        details=details,
    )


@check("env.python_headers", "Python.h present (the extension includes it)", needs=(ENV,))
def python_headers(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    details = {"include": env.python_include}
    if env.python_h:
        return ok(f"Python.h found in {env.python_include}", details=details)
    v = ".".join(env.python_version.split(".")[:2]) or "3"
    return _toolchain_finding(
        facts,
        f"Python.h is missing from {env.python_include}: the build stops with "
        "`fatal error: Python.h: No such file or directory`",
        f"install the headers (Debian/Ubuntu: `apt-get install python{v}-dev`; RHEL: "
        "`dnf install python3-devel`)",
        details=details,
    )


@check(
    "env.transformers",
    "transformers runs Qwen v1 (4.32 to 4.53 as shipped; 4.54 on with the compatibility module)",
    needs=(ENV,),
)
def transformers_version(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    ver = env.transformers_version
    details = {"transformers": ver}
    if ver is None:
        return fail(
            "transformers is not installed, so the model cannot be loaded",
            TRANSFORMERS_PIN_FIX,
            details=details,
        )
    v = _v(ver)
    if v is None:
        return warn(
            f"unrecognised transformers version {ver!r}",
            TRANSFORMERS_PIN_FIX,
            details=details,
        )
    if v < TRANSFORMERS_MIN:
        return fail(
            f"transformers {ver} is older than 4.32: its generate() has a different "
            "signature from the one Qwen's remote code is written for",
            TRANSFORMERS_PIN_FIX,
            details=details,
        )
    broken = tokenizer_failure(v)
    if broken is not None:
        measured_on, how = broken
        upgrade = FIRST_WORKING
        return warn(
            f"transformers {ver}: Qwen's tokenizer fails on {v[0]}.{v[1]} (measured on "
            f"{measured_on}: {how})",
            f'pip install -U "transformers>={_vs(upgrade)}"' if upgrade else None,
            details=details,
        )
    if v >= TRANSFORMERS_FIRST_BROKEN:
        return ok(
            f"transformers {ver} runs Qwen v1 through qwen-kvprep's compatibility module "
            "(qwen_kvprep_compat.py, which fix adds beside modeling_qwen.py: Qwen's code as "
            "shipped fails on 4.54 and later, and from 5.0 loads other weights than the "
            "checkpoint's)",
            details=details,
        )
    if v >= TRANSFORMERS_QWEN_PIN:
        return ok(
            f"transformers {ver} runs Qwen v1 (measured; Qwen itself pins < 4.38)",
            details=details,
        )
    return ok(f"transformers {ver} runs Qwen v1", details=details)


@check("env.remote_requirements", "Packages the Qwen remote code imports", needs=(ENV,))
def remote_requirements(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    if getattr(facts.checkpoint, "requirements", None):
        # The checkpoint probe read the remote code's real imports: checkpoint.requirements
        # reports the same failure more precisely, so say it once.
        return skip(
            "checked against the checkpoint's own imports (see checkpoint.requirements)",
        )
    found = {m: env.package(m) for m in REMOTE_REQUIREMENTS}
    missing = [m for m, p in found.items() if not p.found]
    details = {m: p.version if p.found else None for m, p in found.items()}
    if missing:
        return fail(
            "transformers refuses to load the remote code: `ImportError: This modeling file "
            "requires the following packages that were not found in your environment: "
            f"{', '.join(missing)}`",
            f"pip install {' '.join(missing)}",
            details=details,
        )
    listing = ", ".join(f"{m} {p.version or '?'}" for m, p in found.items())
    return ok(
        f"remote-code requirements importable: {listing}",
        details=details,
    )


def _config(facts: Facts) -> Optional[dict[str, JSON]]:
    cp = facts.checkpoint
    cfg = getattr(cp, "config", None) if cp is not None else None
    return cfg if isinstance(cfg, dict) else None


@check("env.flash_attn", "flash-attn installed while the config would turn it on", needs=(ENV,))
def flash_attn(facts: Facts) -> FindingsLike:
    env = env_of(facts)
    fa = env.package("flash_attn")
    details: dict[str, object] = {"flash_attn": fa.version if fa.found else None}
    cfg = _config(facts)
    if facts.checkpoint is None or cfg is None:
        reason = "no checkpoint given" if facts.checkpoint is None else "config.json not readable"
        if fa.found:
            return info(
                f"flash-attn {fa.version or '(version unknown)'} is installed: a checkpoint "
                f"with the quantized cache must set use_flash_attn false ({reason})",
                details=details,
            )
        return skip(reason, details=details)
    use_flash = cfg.get("use_flash_attn", "auto")
    quant = cfg.get("use_cache_quantization") is True
    details.update(use_flash_attn=use_flash, use_cache_quantization=quant)
    if not fa.found:
        return ok(
            "flash-attn is not installed, so the flash path cannot turn on",
            details=details,
        )
    if use_flash is False:
        return ok(
            f"flash-attn {fa.version} is installed and use_flash_attn is false",
            details=details,
        )
    if cfg.get("fp32") is True:
        return ok(
            "flash-attn is installed but the model runs in fp32, so it stays off",
            details=details,
        )
    fix = f"{facts.checkpoint.fix_command} (sets use_flash_attn false)"
    if not quant:
        return info(
            f"flash-attn {fa.version} is installed and use_flash_attn is {use_flash!r}: once "
            "the quantized cache is on, this must be false",
            fix,
            details=details,
        )
    message = (
        f"flash-attn {fa.version} is installed and use_flash_attn is {use_flash!r} with the "
        "quantized cache on: in half precision on a GPU the flash path receives the "
        "quantized tuples and fails with `'tuple' object has no attribute 'dtype'`"
    )
    if env.gpus or env.torch_is_cuda:
        return fail(message, fix, details=details)
    return warn(message + " (no GPU here, so not yet)", fix, details=details)


@check(
    "env.gptq",
    "GPTQ packages for Int4 checkpoints",
    needs=(ENV, GIVEN_CHECKPOINT),
)
def gptq(facts: Facts) -> FindingsLike:
    """What transformers' GPTQ loader (GptqHfQuantizer, through optimum) needs, by version.

    Measured on CPU: with transformers 5.24, optimum 2.3.0 with gptqmodel 7.6.0 (torch
    2.13) and 7.7.0 (torch 2.14.1) load and run a GPTQ checkpoint, `fix` with smoke included;
    gptqmodel 7.0 needs transformers >= 5.4. With transformers 4.53.3 (torch 2.13): optimum
    1.24.0, 1.27.0 and 2.0.0 with gptqmodel 2.2.0; optimum 2.1.0 and 2.2.0 fail to import
    gptqmodel 2.2.0 (`cannot import name 'METHOD'`), 2.3.0 asks for gptqmodel >= 7. auto-gptq
    0.7.1 (archived) works with peft 0.10 but fails to import with a recent peft (`cannot
    import name 'PEFT_TYPE_TO_MODEL_MAPPING'`, peft 0.21).
    """
    env = env_of(facts)
    cp = facts.checkpoint
    if not getattr(cp, "gptq", False):
        return skip("not a GPTQ (Int4) checkpoint")
    found = {
        m: env.package(m)
        for m in ("optimum", "gptqmodel", "auto_gptq", "peft", "transformers")
    }
    details: dict[str, object] = {
        m: (p.version if p.found else None) for m, p in found.items()
    }
    ver = {m: p.version for m, p in found.items()}
    install = gptq_install(ver["transformers"], env.torch_version, here=False)
    details["install"] = install
    v = {m: version_tuple(p.version) if p.found else None for m, p in found.items()}
    optimum, gptqmodel, auto_gptq = v["optimum"], v["gptqmodel"], v["auto_gptq"]
    transformers = v["transformers"]
    problems: list[str] = []
    if optimum is None:
        problems.append("optimum is not installed (transformers loads GPTQ through it)")
    if gptqmodel is not None:
        if gptqmodel < (1, 6):
            problems.append(f"gptqmodel {ver['gptqmodel']} is too old (optimum needs >= 1.6)")
        elif gptqmodel >= (4,) and transformers is not None and transformers < (4, 55):
            problems.append(
                f"gptqmodel {ver['gptqmodel']} needs a newer transformers than "
                f"{ver['transformers']}: gptqmodel 2.2.0 is the last for transformers < 4.54"
            )
        if optimum is not None and optimum < (1, 24):
            problems.append(
                f"optimum {ver['optimum']} is too old for gptqmodel (transformers wants "
                "optimum >= 1.24)"
            )
        elif optimum is not None and optimum >= (2, 1) and gptqmodel < (7,):
            problems.append(
                f"optimum {ver['optimum']} cannot use gptqmodel {ver['gptqmodel']} (2.1 and 2.2 "
                "fail to import it, 2.3 asks for gptqmodel >= 7)"
            )
        elif optimum is not None and optimum < (2, 3) and gptqmodel >= (7,):
            problems.append(
                f"optimum {ver['optimum']} predates gptqmodel {ver['gptqmodel']} (use optimum "
                ">= 2.3)"
            )
        if transformers is not None and transformers < (4, 49):
            problems.append(
                f"transformers {ver['transformers']} knows only auto-gptq; gptqmodel needs "
                "transformers >= 4.49"
            )
    elif auto_gptq is not None:
        if auto_gptq < (0, 4, 2):
            problems.append(
                f"auto-gptq {ver['auto_gptq']} is too old (transformers wants >= 0.4.2)"
            )
    else:
        problems.append("no GPTQ backend is installed (gptqmodel, or the archived auto-gptq)")
    if problems:
        return fail(
            "this is a GPTQ Int4 checkpoint, and transformers cannot load it here: "
            + "; ".join(problems),
            install,
            details=details,
        )
    if gptqmodel is not None:
        return ok(
            f"GPTQ checkpoint: optimum {ver['optimum']} and gptqmodel {ver['gptqmodel']} "
            "installed (runs on CPU and CUDA)",
            details=details,
        )
    peft = f" with peft {ver['peft']}" if ver["peft"] else ""
    return info(
        f"GPTQ checkpoint: optimum {ver['optimum']} and auto-gptq {ver['auto_gptq']}{peft} "
        "installed; auto-gptq is archived and fails to import with recent peft releases "
        "(`PEFT_TYPE_TO_MODEL_MAPPING`): gptqmodel is the maintained backend",
        install,
        details=details,
    )
