"""Made-up facts for the checks: a healthy machine, checkpoint and caches, each a frozen
dataclass that a test changes where it is about something else. A CUDA 11.3 torch, nvcc 13
beside a cu121 torch, an H100 with an extension built for sm_80 only, or a lock left by a
killed build need none of those things here. `run` is a check on such facts, with what every
finding owes: the check's own id, and a fix when it warns or fails.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from qwen_kvprep.checks import REGISTRY, load_all, run_one
from qwen_kvprep.findings import Finding, Severity
from qwen_kvprep.probe.binary import BinaryArchs, CodeEntry, parse_arch_label
from qwen_kvprep.probe.caches import BuildRecord, CacheFacts, FolderAccess, ModuleFolder
from qwen_kvprep.probe.checkpoint import CheckpointFacts
from qwen_kvprep.probe.env import CompilerInfo, EnvFacts, GpuInfo, PackageInfo
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.resources import KERNEL_FILES

load_all()

A100 = GpuInfo(0, "NVIDIA A100-SXM4-80GB", (8, 0))
H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", (9, 0))
V100 = GpuInfo(0, "Tesla V100-SXM2-32GB", (7, 0))
P100 = GpuInfo(0, "Tesla P100-PCIE-16GB", (6, 0))
RTX5090 = GpuInfo(0, "NVIDIA GeForce RTX 5090", (12, 0))
CKPT = Path("/models/Qwen-7B-Chat")


def packages(**versions: Optional[str]) -> dict[str, PackageInfo]:
    base: dict[str, Optional[str]] = {
        "transformers": "4.37.2",
        "tiktoken": "0.6.0",
        "einops": "0.7.0",
        "transformers_stream_generator": "0.0.4",
        "flash_attn": None,
        "auto_gptq": None,
        "optimum": None,
        "gptqmodel": None,
    }
    base.update(versions)
    return {m: PackageInfo(m, v is not None, v) for m, v in base.items()}


def env_facts(**kw: Any) -> EnvFacts:
    """A healthy CUDA 12.1 machine with one A100; override what a test is about."""
    base = EnvFacts(
        python_version="3.11.7",
        python_executable="/venv/bin/python",
        python_include="/usr/include/python3.11",
        python_h=True,
        platform="linux",
        machine="x86_64",
        torch_version="2.1.2+cu121",
        torch_cuda="12.1",
        torch_arch_flags=("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
        cxx11_abi=False,
        cuda_available=True,
        gpus=(A100,),
        gpu_source="torch",
        driver_version="535.104.05",
        driver_cuda="12.2",
        cuda_home="/usr/local/cuda-12.1",
        cuda_home_source="CUDA_HOME",
        cuda_home_env="/usr/local/cuda-12.1",
        nvcc_on_path="/usr/local/cuda-12.1/bin/nvcc",
        nvcc_path="/usr/local/cuda-12.1/bin/nvcc",
        nvcc_version="12.1",
        nvcc_build="V12.1.105",
        cuda_lib_dir="/usr/local/cuda-12.1/lib64",
        cudart_found=True,
        nvcc_max_gcc=12,
        nvcc_max_clang=15,
        cuda_candidates=("/usr/local/cuda-12.1",),
        cxx=CompilerInfo("c++", "/usr/bin/c++", "gcc", "11.4.0"),
        nvcc_host=CompilerInfo("gcc", "/usr/bin/gcc", "gcc", "11.4.0"),
        ninja_path="/venv/bin/ninja",
        ninja_version="1.11.1",
        ninja_beside_python="/venv/bin/ninja",
        transformers_version="4.37.2",
        packages=packages(),
    )
    return dataclasses.replace(base, **kw)


def cpu_env(**kw: Any) -> EnvFacts:
    cpu: dict[str, Any] = {
        "torch_version": "2.13.0+cpu",
        "torch_cuda": None,
        "torch_arch_flags": (),
        "cuda_available": False,
        "gpus": (),
        "gpu_source": None,
        "driver_version": None,
        "driver_cuda": None,
    }
    cpu.update(kw)
    return env_facts(**cpu)


def usr_local(**kw: Any) -> EnvFacts:
    """torch takes /usr/local for CUDA_HOME because `nvcc` sits in /usr/local/bin (a link
    or wrapper), and /usr/local holds no libcudart: `cannot find -lcudart`."""
    return env_facts(
        cuda_home="/usr/local",
        cuda_home_source="nvcc-on-path",
        cuda_home_env=None,
        nvcc_on_path="/usr/local/bin/nvcc",
        nvcc_path="/usr/local/bin/nvcc",
        cuda_lib_dir="/usr/local/lib",
        cudart_found=False,
        **kw,
    )


def ckpt(**kw: Any) -> CheckpointFacts:
    cfg = {
        "model_type": "qwen",
        "use_cache_quantization": True,
        "use_cache_kernel": True,
        "use_flash_attn": False,
    }
    base = CheckpointFacts(
        path=CKPT,
        name=CKPT.name,
        config=cfg,
        gptq=False,
        loader_is_ours=True,
        kernel_sources={n: "a" * 64 for n in KERNEL_FILES},
    )
    return dataclasses.replace(base, **kw)


def _arch_list(entries: tuple[CodeEntry, ...]) -> list[str]:
    """The manifest's arch_list for the code a binary carries ("8.0", "9.0a", "8.0+PTX")."""
    ptx = {e.arch for e in entries if e.kind == "ptx"}
    out = []
    for e in entries:
        if e.kind == "sass":
            major, minor = e.capability
            out.append(f"{major}.{minor}{e.variant}" + ("+PTX" if e.arch in ptx else ""))
    return out


def build(
    archs: tuple[str, ...] = ("sm_80",),
    cuda: bool = True,
    torch: str = "2.1.2+cu121",
    key: str = "k1",
    arch_list: Optional[list[str]] = None,
) -> BuildRecord:
    entries = tuple(e for e in (parse_arch_label(a) for a in archs) if e)
    claimed = _arch_list(entries) if arch_list is None else arch_list
    so = f"/cache/builds/{key}/cache_autogptq_cuda_256.so"
    return BuildRecord(
        dir=f"/cache/builds/{key}",
        key=key,
        manifest={
            "manifest_version": 1,
            "key": key,
            "cuda": cuda,
            "so": "cache_autogptq_cuda_256.so",
            "inputs": {
                "torch": torch,
                "cxx11_abi": False,
                "python_tag": "cp311",
                "machine": "linux-x86_64",
                "arch_list": claimed if cuda else [],
            },
        },
        so_path=so,
        so_exists=True,
        archs=BinaryArchs(so, entries) if cuda else None,
    )


def folder(
    exists: bool = True, loader: Optional[bool] = True, sources: bool = True, **kw: Any
) -> ModuleFolder:
    files: dict[str, Optional[str]] = {n: ("a" * 64 if sources else None) for n in KERNEL_FILES}
    files["cpp_kernels.py"] = "b" * 64 if loader is not None else None
    files["modeling_qwen.py"] = "c" * 64
    return ModuleFolder(
        "/hf/modules/transformers_modules/Qwen-7B-Chat",
        "local path",
        exists,
        files if exists else {},
        loader if exists else None,
        **kw,
    )


def caches(**kw: Any) -> CacheFacts:
    base = CacheFacts(
        build_cache=FolderAccess("/cache", "QWEN_KVPREP_CACHE", True, True),
        builds=(),
        modules_root=FolderAccess("/hf/modules", "HF_MODULES_CACHE", True, True),
        module_folders=(folder(),),
        locks=(),
        locks_scanned=True,
        python_tag="cp311",
        machine="linux-x86_64",
    )
    return dataclasses.replace(base, **kw)


def facts(
    env: Optional[EnvFacts] = None, checkpoint: Any = None, cache: Optional[CacheFacts] = None
) -> Facts:
    return Facts(env=env if env is not None else env_facts(), checkpoint=checkpoint, caches=cache)


def run(check_id: str, f: Facts) -> list[Finding]:
    found = run_one(REGISTRY[check_id], f)
    assert found, f"{check_id} returned nothing"
    assert all(x.id == check_id for x in found)
    for x in found:
        if x.severity in (Severity.WARN, Severity.FAIL):
            assert x.fix, f"{check_id}: a {x.severity.value} finding needs a fix: {x.message}"
    return found


def worst(check_id: str, f: Facts) -> Severity:
    return max((x.severity for x in run(check_id, f)), key=lambda s: s.rank)


def text(check_id: str, f: Facts) -> str:
    return "\n".join(f"{x.message} || {x.fix}" for x in run(check_id, f))


ENV_AND_CACHE_CHECKS = [
    "env.python",
    "env.torch",
    "env.gpu",
    "env.driver",
    "env.cuda_home",
    "env.nvcc",
    "env.host_compiler",
    "env.ninja",
    "env.python_headers",
    "env.transformers",
    "env.remote_requirements",
    "env.flash_attn",
    "env.gptq",
    "build.cache",
    "build.arch",
    "modules.cache",
    "modules.folder",
    "modules.stale_lock",
]
