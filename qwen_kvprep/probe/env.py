"""Probe the Python/torch/CUDA environment. Reads only; never raises.

Everything here must work without torch, transformers, a GPU, nvcc or a writable file
system: each missing piece becomes a fact (None, False or an error string) that a check
turns into a finding. torch is the only heavy package imported (its CUDA build, ABI flag
and GPUs cannot be read otherwise); every other package is looked up with
`importlib.util.find_spec` and `importlib.metadata`, which do not run it, except those of
IMPORT_TO_KNOW: installed, they may still fail to import on the running transformers, and
"installed" means importable.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.metadata
import importlib.util
import io
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from qwen_kvprep.common import resolve_cuda_home

# Subprocesses (nvcc, the compilers, ninja) answer `--version` in milliseconds; the
# timeout only guards against a wrapper script that hangs.
TOOL_TIMEOUT_S = 10.0

# Environment variables that decide how the extension is built and found; their values
# go into facts (and, redacted, into --report).
RELEVANT_ENV = (
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_VISIBLE_DEVICES",
    "TORCH_CUDA_ARCH_LIST",
    "TORCH_EXTENSIONS_DIR",
    "TORCH_DONT_CHECK_COMPILER_ABI",
    "CC",
    "CXX",
    "MAX_JOBS",
    "PATH",
    "LD_LIBRARY_PATH",
    "HF_HOME",
    "HF_MODULES_CACHE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_ENDPOINT",
    "XDG_CACHE_HOME",
    "QWEN_KVPREP_CACHE",
)

# module name -> distribution names to ask importlib.metadata for (spellings differ).
PACKAGES: Mapping[str, tuple[str, ...]] = {
    "transformers": ("transformers",),
    "huggingface_hub": ("huggingface-hub", "huggingface_hub"),
    "tiktoken": ("tiktoken",),
    "einops": ("einops",),
    "transformers_stream_generator": (
        "transformers-stream-generator",
        "transformers_stream_generator",
    ),
    "flash_attn": ("flash-attn", "flash_attn"),
    "auto_gptq": ("auto-gptq", "auto_gptq"),
    "optimum": ("optimum",),
    "gptqmodel": ("gptqmodel",),
    "peft": ("peft",),  # auto-gptq imports it
}

# Packages found only when they import: transformers_stream_generator imports names that
# transformers removed (BeamSearchScorer in 4.57, DisjunctiveConstraint in 5.0), so on
# newer releases it is installed and yet `import transformers_stream_generator` fails.
IMPORT_TO_KNOW = ("transformers_stream_generator",)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    capability: tuple[int, int]

    @property
    def label(self) -> str:
        return f"{self.name} ({self.capability[0]}.{self.capability[1]})"


@dataclass(frozen=True)
class PackageInfo:
    module: str
    found: bool  # importable (for IMPORT_TO_KNOW: imported here without an error)
    version: Optional[str] = None  # the installed distribution's, also when it cannot import
    error: Optional[str] = None  # installed, but `import module` failed: how


@dataclass(frozen=True)
class CompilerInfo:
    command: str  # as it would be run: $CXX / $CC or the default name
    path: Optional[str] = None  # resolved on PATH; None: not found
    kind: str = "unknown"  # "gcc" | "clang" | "unknown"
    version: Optional[str] = None  # "12.2.0"
    error: Optional[str] = None


@dataclass(frozen=True)
class EnvFacts:
    """What the environment is. Every field has a default so tests can fabricate one."""

    python_version: str = ""
    python_executable: str = ""
    python_include: Optional[str] = None
    python_h: bool = False
    platform: str = "linux"
    machine: str = ""

    torch_version: Optional[str] = None
    torch_error: Optional[str] = None  # why `import torch` failed
    torch_cuda: Optional[str] = None  # torch.version.cuda; None for a CPU build
    torch_hip: Optional[str] = None
    torch_arch_flags: tuple[str, ...] = ()  # the GPU code torch itself was built with
    cxx11_abi: Optional[bool] = None
    cuda_available: Optional[bool] = None
    gpus: tuple[GpuInfo, ...] = ()
    gpu_source: Optional[str] = None  # "torch" | "nvml"
    gpu_error: Optional[str] = None  # what torch said when CUDA did not initialise

    driver_version: Optional[str] = None  # "535.104.05"
    driver_cuda: Optional[str] = None  # newest CUDA the driver supports, "12.2"

    # CUDA_HOME as torch.utils.cpp_extension resolves it, and the raw inputs.
    cuda_home: Optional[str] = None
    cuda_home_source: str = (
        "none"  # "CUDA_HOME" | "CUDA_PATH" | "nvcc-on-path" | "default" | "none"
    )
    cuda_home_env: Optional[str] = None
    cuda_path_env: Optional[str] = None
    nvcc_on_path: Optional[str] = None
    nvcc_path: Optional[str] = None  # <cuda_home>/bin/nvcc when it exists
    nvcc_version: Optional[str] = None  # "12.1"
    nvcc_build: Optional[str] = None  # "V12.1.105"
    nvcc_error: Optional[str] = None
    cuda_lib_dir: Optional[str] = None  # the folder torch passes as -L
    cudart_found: Optional[bool] = None  # libcudart.so / .a in cuda_lib_dir
    nvcc_max_gcc: Optional[int] = None  # from <cuda_home>'s crt/host_config.h
    nvcc_max_clang: Optional[int] = None
    cuda_candidates: tuple[str, ...] = ()  # installed toolkits with bin/nvcc and libcudart

    cxx: Optional[CompilerInfo] = None  # what torch compiles .cpp with ($CXX or c++)
    nvcc_host: Optional[CompilerInfo] = None  # what nvcc uses ($CC via -ccbin, else gcc)

    ninja_path: Optional[str] = None  # `ninja` on PATH (how torch runs it)
    ninja_version: Optional[str] = None
    ninja_beside_python: Optional[str] = None  # <venv>/bin/ninja, whether on PATH or not

    transformers_version: Optional[str] = None
    packages: Mapping[str, PackageInfo] = field(default_factory=dict)
    env_vars: Mapping[str, str] = field(default_factory=dict)

    def package(self, module: str) -> PackageInfo:
        return self.packages.get(module, PackageInfo(module, False))

    @property
    def torch_is_cuda(self) -> bool:
        return self.torch_version is not None and self.torch_cuda is not None


def version_tuple(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """'12.1' -> (12, 1); '4.37.2' -> (4, 37, 2); '2.1.0+cu121' -> (2, 1, 0); junk -> None."""
    if not text:
        return None
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    if not m:
        return None
    return tuple(int(p) for p in m.group(1).split("."))


def _run(
    cmd: Sequence[str], env: Optional[Mapping[str, str]] = None
) -> tuple[Optional[str], Optional[str]]:
    """(stdout+stderr, None) or (None, why it failed)."""
    try:
        res = subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT_S,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None, f"`{' '.join(cmd)}` did not answer within {TOOL_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return None, f"`{' '.join(cmd)}` could not run: {exc.strerror or exc}"
    out = (res.stdout or "") + (res.stderr or "")
    if res.returncode != 0:
        first = out.strip().splitlines()[:1]
        return None, f"`{' '.join(cmd)}` exited {res.returncode}" + (
            f": {first[0]}" if first else ""
        )
    return out, None


# ---------------------------------------------------------------------------------------
# Python


def _python_include() -> tuple[Optional[str], bool]:
    # torch's cpp_extension takes Python.h from this very scheme.
    try:
        inc = sysconfig.get_path("include", scheme="posix_prefix" if os.name != "nt" else "nt")
    except (KeyError, ValueError):
        inc = sysconfig.get_path("include")
    if not inc:
        return None, False
    return inc, os.path.isfile(os.path.join(inc, "Python.h"))


# ---------------------------------------------------------------------------------------
# torch


@dataclass
class _TorchFacts:
    version: Optional[str] = None
    error: Optional[str] = None
    cuda: Optional[str] = None
    hip: Optional[str] = None
    arch_flags: tuple[str, ...] = ()
    abi: Optional[bool] = None
    available: Optional[bool] = None
    gpus: tuple[GpuInfo, ...] = ()
    gpu_error: Optional[str] = None


def _probe_torch() -> _TorchFacts:
    out = _TorchFacts()
    with warnings.catch_warnings():
        # Import-time warnings are noise here, and recording them costs time.
        warnings.simplefilter("ignore")
        try:
            import torch
        except Exception as exc:  # a broken torch raises more than ImportError (OSError, ...)
            out.error = f"{type(exc).__name__}: {exc}".strip()
            return out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out.version = str(torch.__version__)
            out.cuda = getattr(torch.version, "cuda", None)
            out.hip = getattr(torch.version, "hip", None)
            out.abi = bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
            flags = getattr(torch._C, "_cuda_getArchFlags", None)
            if out.cuda and flags is not None:
                out.arch_flags = tuple(str(flags() or "").split())
            if out.cuda:
                out.available = bool(torch.cuda.is_available())
                if out.available:
                    gpus = []
                    for i in range(torch.cuda.device_count()):
                        major, minor = torch.cuda.get_device_capability(i)
                        gpus.append(GpuInfo(i, str(torch.cuda.get_device_name(i)), (major, minor)))
                    out.gpus = tuple(gpus)
            else:
                out.available = False
        except Exception as exc:  # a CUDA init failure must not stop the probe
            out.gpu_error = f"{type(exc).__name__}: {exc}"
    if out.cuda and not out.gpus and out.gpu_error is None:
        # torch explains a failed CUDA init (driver too old, no device) only as a warning.
        texts = [str(w.message) for w in caught if "CUDA" in str(w.message)]
        if texts:
            out.gpu_error = texts[0].strip().splitlines()[0]
    return out


# ---------------------------------------------------------------------------------------
# NVIDIA driver, without nvidia-smi


def _driver_from_proc() -> Optional[str]:
    for path in ("/proc/driver/nvidia/version", "/sys/module/nvidia/version"):
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        m = re.search(r"(\d{3,}\.\d+(?:\.\d+)?)", text)
        if m:
            return m.group(1)
    return None


def _driver_cuda_version() -> Optional[str]:
    """cuDriverGetVersion from libcuda: the newest CUDA the installed driver supports."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int(0)
    try:
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0 or v.value <= 0:
            return None
    except (AttributeError, OSError):
        return None
    return f"{v.value // 1000}.{(v.value % 1000) // 10}"


def _nvml() -> tuple[Optional[str], tuple[GpuInfo, ...]]:
    """Driver version and GPUs through NVML, used only when torch cannot tell (CPU build,
    no torch). NVML ignores CUDA_VISIBLE_DEVICES, so torch's view is preferred."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None, ()
    try:
        if lib.nvmlInit_v2() != 0:
            return None, ()
    except (AttributeError, OSError):
        return None, ()
    driver: Optional[str] = None
    gpus: list[GpuInfo] = []
    try:
        buf = ctypes.create_string_buffer(96)
        if lib.nvmlSystemGetDriverVersion(buf, 96) == 0:
            driver = buf.value.decode(errors="replace")
        count = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0:
            for i in range(count.value):
                handle = ctypes.c_void_p()
                if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                    continue
                name = ctypes.create_string_buffer(96)
                lib.nvmlDeviceGetName(handle, name, 96)
                major, minor = ctypes.c_int(0), ctypes.c_int(0)
                if (
                    lib.nvmlDeviceGetCudaComputeCapability(
                        handle, ctypes.byref(major), ctypes.byref(minor)
                    )
                    == 0
                ):
                    gpus.append(
                        GpuInfo(i, name.value.decode(errors="replace"), (major.value, minor.value))
                    )
    except (AttributeError, OSError):
        pass
    finally:
        with contextlib.suppress(AttributeError, OSError):
            lib.nvmlShutdown()
    return driver, tuple(gpus)


# ---------------------------------------------------------------------------------------
# CUDA toolkit, as torch.utils.cpp_extension finds it


def cuda_lib_dir(cuda_home: str) -> str:
    # torch's library_paths(): lib64 unless only lib exists.
    lib64 = os.path.join(cuda_home, "lib64")
    lib = os.path.join(cuda_home, "lib")
    if not os.path.exists(lib64) and os.path.exists(lib):
        return lib
    return lib64


def _has_cudart(lib_dir: str) -> bool:
    # `-lcudart` is satisfied by libcudart.so or libcudart.a in a -L folder.
    return any(os.path.exists(os.path.join(lib_dir, n)) for n in ("libcudart.so", "libcudart.a"))


def parse_nvcc_version(text: str) -> tuple[Optional[str], Optional[str]]:
    m = re.search(r"release (\d+\.\d+)", text)
    b = re.search(r"\b(V\d+\.\d+\.\d+)", text)
    return (m.group(1) if m else None, b.group(1) if b else None)


def parse_host_config(text: str) -> tuple[Optional[int], Optional[int]]:
    """Newest gcc and clang majors that nvcc's crt/host_config.h lets through."""
    gcc = re.search(r"#if\s+__GNUC__\s*>\s*(\d+)", text)
    clang = re.search(r"unsupported clang version[^\n]*must be less than (\d+)", text)
    return (int(gcc.group(1)) if gcc else None, int(clang.group(1)) - 1 if clang else None)


def _host_config(cuda_home: str) -> tuple[Optional[int], Optional[int]]:
    candidates = [Path(cuda_home) / "include" / "crt" / "host_config.h"]
    targets = Path(cuda_home) / "targets"
    with contextlib.suppress(OSError):
        candidates += sorted(targets.glob("*/include/crt/host_config.h"))
    for path in candidates:
        try:
            return parse_host_config(path.read_text(errors="replace"))
        except OSError:
            continue
    return None, None


def _cuda_candidates() -> tuple[str, ...]:
    """Installed toolkits a user could point CUDA_HOME at (complete: nvcc and libcudart)."""
    roots: list[Path] = []
    for pattern_root, pattern in (("/usr/local", "cuda*"), ("/opt", "cuda*")):
        try:
            roots += sorted(Path(pattern_root).glob(pattern))
        except OSError:
            continue
    out: list[str] = []
    seen: set[str] = set()
    # Real folders before symlinks, so /usr/local/cuda-12.1 is named rather than the
    # /usr/local/cuda link that points at it.
    roots.sort(key=lambda p: (p.is_symlink(), str(p)))
    for r in roots:
        try:
            real = os.path.realpath(r)
            if real in seen:
                continue
            if os.path.isfile(os.path.join(r, "bin", "nvcc")) and _has_cudart(cuda_lib_dir(str(r))):
                seen.add(real)
                out.append(str(r))
        except OSError:
            continue
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Compilers and ninja


def parse_compiler_version(text: str) -> tuple[str, Optional[str]]:
    first = text.strip().splitlines()[0] if text.strip() else ""
    if "clang" in first.lower():
        m = re.search(r"clang version (\d+(?:\.\d+)*)", first)
        return "clang", m.group(1) if m else None
    kind = (
        "gcc" if ("gcc" in text.lower() or "g++" in first or "Free Software" in text) else "unknown"
    )
    # gcc prints "<name> (<distribution tag>) 12.2.0": the version follows the parenthesis.
    m = re.search(r"\)\s+(\d+\.\d+(?:\.\d+)?)", first) or re.search(
        r"\b(\d+\.\d+(?:\.\d+)?)\b", first
    )
    return kind, m.group(1) if m else None


def _probe_compiler(command: str, cache: dict[str, CompilerInfo]) -> CompilerInfo:
    path = shutil.which(command)
    if path is None:
        return CompilerInfo(command, None, error=f"`{command}` is not on PATH")
    real = os.path.realpath(path)
    if real in cache:
        hit = cache[real]
        return CompilerInfo(command, path, hit.kind, hit.version, hit.error)
    out, err = _run([path, "--version"])
    if out is None:
        info = CompilerInfo(command, path, error=err)
    else:
        kind, version = parse_compiler_version(out)
        info = CompilerInfo(command, path, kind, version)
    cache[real] = info
    return info


def _probe_ninja() -> tuple[Optional[str], Optional[str], Optional[str]]:
    # torch runs `ninja --version` through PATH; a venv's bin/ is on PATH only when the
    # venv is activated, so ninja can be installed and still invisible to torch.
    path = shutil.which("ninja")
    version = None
    if path is not None:
        out, _ = _run([path, "--version"])
        version = out.strip() if out else None
    beside = Path(sys.executable).parent / "ninja"
    return path, version, str(beside) if beside.is_file() else None


# ---------------------------------------------------------------------------------------
# packages


def _dist_version(names: Sequence[str]) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken dist-info must not stop the probe
            continue
    return None


@functools.cache
def import_error(module: str) -> Optional[str]:
    """How `import module` fails in this interpreter (one line), None when it imports.
    Only for IMPORT_TO_KNOW modules that find_spec finds: they import transformers, so
    this costs transformers' import once per process; what they print is dropped, and
    what they log too: a logging handler made earlier (torch's, at its import) holds the
    real stderr, out of redirect_stderr's reach, and torchao, which transformers imports
    where it is installed (with gptqmodel, say), logs warnings at its import."""
    sink = io.StringIO()
    muted = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), \
                contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            importlib.import_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # ImportError, AttributeError, SystemExit from its imports
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    finally:
        logging.disable(muted)
    return None


def _probe_package(module: str, dists: Sequence[str]) -> PackageInfo:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    version = _dist_version(dists) if found else None
    if found and module in IMPORT_TO_KNOW:
        error = import_error(module)
        if error is not None:
            return PackageInfo(module, False, version, error)
    return PackageInfo(module, found, version)


def package_info(module: str) -> PackageInfo:
    """What probe_env says of one package of PACKAGES, without probing the rest."""
    return _probe_package(module, PACKAGES.get(module, (module,)))


# ---------------------------------------------------------------------------------------


def probe_env(environ: Optional[Mapping[str, str]] = None) -> EnvFacts:
    """Gather EnvFacts. Never raises, never writes."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    include, python_h = _python_include()
    tf = _probe_torch()

    driver = _driver_from_proc()
    driver_cuda = _driver_cuda_version()
    gpus, gpu_source = tf.gpus, "torch" if tf.gpus else None
    if driver is None or (tf.cuda is None and not tf.gpus):
        nvml_driver, nvml_gpus = _nvml()
        driver = driver or nvml_driver
        # Only when torch cannot see GPUs at all (no torch, a CPU build): for a CUDA
        # build, what torch sees (CUDA_VISIBLE_DEVICES, a failed init) is the truth.
        if tf.cuda is None and nvml_gpus:
            gpus, gpu_source = nvml_gpus, "nvml"

    which_nvcc = shutil.which("nvcc", path=env.get("PATH"))
    cuda_home, source = resolve_cuda_home(env, which_nvcc)
    nvcc_path = nvcc_version = nvcc_build = nvcc_error = None
    lib_dir: Optional[str] = None
    cudart: Optional[bool] = None
    max_gcc = max_clang = None
    if cuda_home is not None:
        candidate = os.path.join(cuda_home, "bin", "nvcc")
        if os.path.isfile(candidate):
            nvcc_path = candidate
            out, nvcc_error = _run([candidate, "--version"])
            if out is not None:
                nvcc_version, nvcc_build = parse_nvcc_version(out)
                if nvcc_version is None:
                    nvcc_error = f"`{candidate} --version` printed no release number"
            max_gcc, max_clang = _host_config(cuda_home)
        lib_dir = cuda_lib_dir(cuda_home)
        cudart = _has_cudart(lib_dir)

    compilers: dict[str, CompilerInfo] = {}
    cxx = _probe_compiler(env.get("CXX") or "c++", compilers)
    # nvcc calls its default host compiler `gcc` unless torch hands it -ccbin $CC.
    nvcc_host = _probe_compiler(env.get("CC") or "gcc", compilers)
    ninja_path, ninja_version, ninja_beside = _probe_ninja()

    packages = {m: _probe_package(m, d) for m, d in PACKAGES.items()}

    return EnvFacts(
        python_version=platform.python_version(),
        python_executable=sys.executable,
        python_include=include,
        python_h=python_h,
        platform=sys.platform,
        machine=platform.machine(),
        torch_version=tf.version,
        torch_error=tf.error,
        torch_cuda=tf.cuda,
        torch_hip=tf.hip,
        torch_arch_flags=tf.arch_flags,
        cxx11_abi=tf.abi,
        cuda_available=tf.available,
        gpus=gpus,
        gpu_source=gpu_source,
        gpu_error=tf.gpu_error,
        driver_version=driver,
        driver_cuda=driver_cuda,
        cuda_home=cuda_home,
        cuda_home_source=source,
        cuda_home_env=env.get("CUDA_HOME"),
        cuda_path_env=env.get("CUDA_PATH"),
        nvcc_on_path=which_nvcc,
        nvcc_path=nvcc_path,
        nvcc_version=nvcc_version,
        nvcc_build=nvcc_build,
        nvcc_error=nvcc_error,
        cuda_lib_dir=lib_dir,
        cudart_found=cudart,
        nvcc_max_gcc=max_gcc,
        nvcc_max_clang=max_clang,
        cuda_candidates=_cuda_candidates(),
        cxx=cxx,
        nvcc_host=nvcc_host,
        ninja_path=ninja_path,
        ninja_version=ninja_version,
        ninja_beside_python=ninja_beside,
        transformers_version=packages["transformers"].version,
        packages=packages,
        env_vars={k: env[k] for k in RELEVANT_ENV if k in env},
    )


def summary(facts: EnvFacts) -> dict[str, Union[str, bool, None]]:
    """A flat, JSON-friendly view (for --report and --json extras)."""
    return {
        "python": f"{facts.python_version} ({facts.python_executable})",
        "torch": facts.torch_version or f"not importable: {facts.torch_error}",
        "torch CUDA": facts.torch_cuda or ("CPU build" if facts.torch_version else "-"),
        "C++11 ABI": facts.cxx11_abi,
        "GPUs": ", ".join(g.label for g in facts.gpus) or "none visible",
        "driver": facts.driver_version or "-",
        "driver CUDA": facts.driver_cuda or "-",
        "CUDA_HOME (resolved)": f"{facts.cuda_home} (from {facts.cuda_home_source})",
        "nvcc": facts.nvcc_version or facts.nvcc_error or "-",
        "host compiler (nvcc)": _compiler_label(facts.nvcc_host),
        "C++ compiler": _compiler_label(facts.cxx),
        "ninja": facts.ninja_path or "not on PATH",
        "transformers": facts.transformers_version or "not installed",
        "packages": ", ".join(
            f"{p.module} {p.version or '?'}"
            + (" (installed, cannot be imported)" if p.error is not None else "")
            for p in facts.packages.values()
            if p.found or p.error is not None
        ),
    }


def _compiler_label(c: Optional[CompilerInfo]) -> str:
    if c is None:
        return "-"
    if c.path is None or c.error:
        return f"{c.command}: {c.error}"
    return f"{c.command} = {c.kind} {c.version or '?'}"
