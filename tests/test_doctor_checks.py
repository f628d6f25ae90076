"""Every env./build./modules. check on fabricated facts: its ok and its not-ok cases.

The facts are plain frozen dataclasses, so a CUDA 11.3 torch, nvcc 13 beside a cu121
torch, an H100 with an extension built for sm_80 only, or a lock left by a killed build
need none of those things here. Probes are tested against real files where that is cheap
(a real fatbin compiled with nvcc when there is one, a lock held by a real process).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from qwen_kvprep.checks import REGISTRY, Check, load_all, run_checks, run_one
from qwen_kvprep.findings import Finding, Severity
from qwen_kvprep.probe.binary import BinaryArchs, CodeEntry, parse_arch_label, read_archs, runs_on
from qwen_kvprep.probe.caches import (
    BuildRecord,
    CacheFacts,
    FolderAccess,
    LockFile,
    ModuleFolder,
    folder_access,
    module_folder_candidates,
    modules_cache_root,
    open_file_holders,
    probe_caches,
    usable_builds,
)
from qwen_kvprep.probe.checkpoint import CheckpointFacts
from qwen_kvprep.probe.env import (
    CompilerInfo,
    EnvFacts,
    GpuInfo,
    PackageInfo,
    parse_compiler_version,
    parse_host_config,
    parse_nvcc_version,
    resolve_cuda_home,
    version_tuple,
)
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.resources import KERNEL_FILES
from tests import needs

load_all()

A100 = GpuInfo(0, "NVIDIA A100-SXM4-80GB", (8, 0))
H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", (9, 0))
V100 = GpuInfo(0, "Tesla V100-SXM2-32GB", (7, 0))
P100 = GpuInfo(0, "Tesla P100-PCIE-16GB", (6, 0))
RTX5090 = GpuInfo(0, "NVIDIA GeForce RTX 5090", (12, 0))
CKPT = Path("/models/Qwen-7B-Chat")


def _pkgs(**versions: Optional[str]) -> dict[str, PackageInfo]:
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
        packages=_pkgs(),
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


MY_CHECKS = [
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


def test_all_checks_registered() -> None:
    for cid in MY_CHECKS:
        assert cid in REGISTRY, cid


@pytest.mark.parametrize("cid", MY_CHECKS)
def test_every_check_skips_without_its_facts(cid: str) -> None:
    found = run(cid, Facts())
    assert all(x.severity is Severity.SKIP for x in found), found


# ---------------------------------------------------------------------------------------
# env.python / env.torch / env.gpu


def test_python() -> None:
    assert worst("env.python", facts()) is Severity.OK
    assert worst("env.python", facts(env_facts(python_version="3.8.18"))) is Severity.FAIL


@pytest.mark.parametrize(
    ("cuda", "expected"),
    [("11.3", Severity.FAIL), ("11.4", Severity.OK), ("12.1", Severity.OK), ("13.0", Severity.OK)],
)
def test_torch_cuda_versions(cuda: str, expected: Severity) -> None:
    f = facts(env_facts(torch_version=f"2.1.2+cu{cuda.replace('.', '')}", torch_cuda=cuda))
    assert worst("env.torch", f) is expected
    if expected is Severity.FAIL:
        assert "11.4" in text("env.torch", f)


def test_torch_cpu_build_is_info() -> None:
    found = run("env.torch", facts(cpu_env()))
    assert [x.severity for x in found] == [Severity.INFO]
    assert "CPU kernel path only" in found[0].message


def test_torch_missing() -> None:
    f = facts(
        env_facts(
            torch_version=None,
            torch_cuda=None,
            torch_error="ModuleNotFoundError: No module named 'torch'",
        )
    )
    assert worst("env.torch", f) is Severity.FAIL
    assert "No module named 'torch'" in text("env.torch", f)


def test_torch_rocm_and_old() -> None:
    assert worst("env.torch", facts(env_facts(torch_hip="6.0"))) is Severity.WARN
    assert (
        worst("env.torch", facts(env_facts(torch_version="1.13.1+cu117", torch_cuda="11.7")))
        is Severity.WARN
    )


def test_gpu_ok_and_capability_listed() -> None:
    found = run("env.gpu", facts(env_facts(gpus=(A100, dataclasses.replace(H100, index=1)))))
    assert [x.severity for x in found] == [Severity.OK, Severity.OK]
    assert "(8.0)" in found[0].message and "(9.0)" in found[1].message


def test_gpu_not_visible() -> None:
    assert worst("env.gpu", facts(env_facts(gpus=()))) is Severity.INFO
    f = facts(
        env_facts(
            gpus=(), gpu_error="The NVIDIA driver on your system is too old (found version 11040)."
        )
    )
    assert worst("env.gpu", f) is Severity.WARN
    assert "too old" in text("env.gpu", f)


def test_gpu_with_cpu_torch_is_a_warning() -> None:
    f = facts(cpu_env(gpus=(H100,), gpu_source="nvml"))
    assert worst("env.gpu", f) is Severity.WARN
    assert "CPU build" in text("env.gpu", f)


def test_gpu_too_old_for_the_kernel() -> None:
    assert worst("env.gpu", facts(env_facts(gpus=(P100,)))) is Severity.FAIL


def test_gpu_that_torch_has_no_code_for() -> None:
    f = facts(env_facts(gpus=(RTX5090,)))
    assert worst("env.gpu", f) is Severity.FAIL
    assert "no kernel image is available" in text("env.gpu", f)
    with_ptx = env_facts(gpus=(RTX5090,), torch_arch_flags=("sm_80", "sm_90", "compute_90"))
    assert worst("env.gpu", facts(with_ptx)) is Severity.OK


# ---------------------------------------------------------------------------------------
# env.driver


def test_driver_new_enough() -> None:
    assert worst("env.driver", facts()) is Severity.OK


def test_driver_minor_version_compatibility_is_a_warning() -> None:
    f = facts(env_facts(driver_version="525.85.12", driver_cuda="12.0"))
    assert worst("env.driver", f) is Severity.WARN


def test_driver_too_old() -> None:
    f = facts(env_facts(driver_version="470.199.02", driver_cuda="11.4"))
    assert worst("env.driver", f) is Severity.FAIL
    assert "insufficient" in text("env.driver", f)


def test_driver_cuda13_needs_580() -> None:
    torch13 = {"torch_version": "2.9.0+cu130", "torch_cuda": "13.0"}
    assert (
        worst(
            "env.driver",
            facts(env_facts(driver_version="575.57.08", driver_cuda="12.9", **torch13)),
        )
        is Severity.FAIL
    )
    # driver version only (no libcuda answer): judged against the release table
    assert (
        worst(
            "env.driver", facts(env_facts(driver_version="580.65.06", driver_cuda=None, **torch13))
        )
        is Severity.OK
    )
    assert (
        worst(
            "env.driver", facts(env_facts(driver_version="575.57.08", driver_cuda=None, **torch13))
        )
        is Severity.FAIL
    )


def test_driver_version_only_table() -> None:
    assert (
        worst("env.driver", facts(env_facts(driver_cuda=None, driver_version="530.30.02")))
        is Severity.OK
    )
    assert (
        worst("env.driver", facts(env_facts(driver_cuda=None, driver_version="525.60.13")))
        is Severity.WARN
    )
    assert (
        worst("env.driver", facts(env_facts(driver_cuda=None, driver_version="515.65.01")))
        is Severity.FAIL
    )


def test_driver_not_needed_for_cpu_torch() -> None:
    assert worst("env.driver", facts(cpu_env())) is Severity.SKIP
    assert (
        worst("env.driver", facts(env_facts(gpus=(), driver_version=None, driver_cuda=None)))
        is Severity.INFO
    )


# ---------------------------------------------------------------------------------------
# env.cuda_home


def test_cuda_home_ok() -> None:
    assert worst("env.cuda_home", facts()) is Severity.OK


def test_cuda_home_path_list() -> None:
    value = "/usr/local/cuda:/opt/x"
    f = facts(env_facts(cuda_home=value, cuda_home_env=value, nvcc_path=None, cudart_found=False))
    assert worst("env.cuda_home", f) is Severity.FAIL
    assert "path list" in text("env.cuda_home", f)
    assert "export CUDA_HOME=/usr/local/cuda-12.1" in text("env.cuda_home", f)


def test_cuda_home_unset_without_nvcc() -> None:
    f = facts(
        env_facts(
            cuda_home=None,
            cuda_home_source="none",
            cuda_home_env=None,
            nvcc_on_path=None,
            nvcc_path=None,
            nvcc_version=None,
            cuda_candidates=(),
        )
    )
    assert worst("env.cuda_home", f) is Severity.FAIL
    assert "CUDA_HOME environment variable is not set" in text("env.cuda_home", f)
    assert "install the CUDA 12.1 toolkit" in text("env.cuda_home", f)


def test_cuda_home_without_nvcc() -> None:
    f = facts(
        env_facts(
            cuda_home="/opt/cuda-runtime",
            cuda_home_env="/opt/cuda-runtime",
            nvcc_path=None,
            nvcc_version=None,
        )
    )
    assert worst("env.cuda_home", f) is Severity.FAIL
    assert "nvcc not found at '/opt/cuda-runtime/bin/nvcc'" in text("env.cuda_home", f)


def _usr_local(**kw: Any) -> EnvFacts:
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


def test_cuda_home_usr_local_trap() -> None:
    f = facts(_usr_local(), checkpoint=ckpt(loader_is_ours=False))
    assert worst("env.cuda_home", f) is Severity.FAIL
    t = text("env.cuda_home", f)
    assert "-lcudart" in t and "/usr/local/bin/nvcc" in t
    assert "export CUDA_HOME=/usr/local/cuda-12.1" in t
    # qwen-kvprep's own builder steps over the wrapper: only torch's JIT path is broken
    assert worst("env.cuda_home", facts(_usr_local(), checkpoint=ckpt())) is Severity.WARN
    assert worst("env.cuda_home", facts(_usr_local(cuda_candidates=()))) is Severity.FAIL


def test_cuda_home_not_needed_for_cpu_torch() -> None:
    assert worst("env.cuda_home", facts(cpu_env(cuda_home=None, nvcc_path=None))) is Severity.SKIP


def test_toolchain_failure_is_a_warning_when_a_build_exists() -> None:
    env = env_facts(cuda_home="/opt/x", cuda_home_env="/opt/x", nvcc_path=None, nvcc_version=None)
    assert worst("env.cuda_home", facts(env, cache=caches())) is Severity.FAIL
    with_build = caches(builds=(build(),))
    assert worst("env.cuda_home", facts(env, cache=with_build)) is Severity.WARN
    other_torch = caches(builds=(build(torch="2.0.1+cu118"),))
    assert worst("env.cuda_home", facts(env, cache=other_torch)) is Severity.FAIL


# ---------------------------------------------------------------------------------------
# env.nvcc


def test_nvcc_matches() -> None:
    assert worst("env.nvcc", facts()) is Severity.OK


def test_nvcc13_with_torch_cu121_fails() -> None:
    f = facts(env_facts(nvcc_version="13.0", nvcc_build="V13.0.88", nvcc_max_gcc=15))
    assert worst("env.nvcc", f) is Severity.FAIL
    assert "mismatches the version that was used to compile PyTorch (12.1)" in text("env.nvcc", f)


def test_nvcc_minor_difference_warns() -> None:
    assert worst("env.nvcc", facts(env_facts(nvcc_version="12.4"))) is Severity.WARN
    assert (
        worst(
            "env.nvcc",
            facts(env_facts(nvcc_version="11.4", torch_cuda="11.8", torch_version="2.1.2+cu118")),
        )
        is Severity.WARN
    )


def test_nvcc_too_old() -> None:
    f = facts(env_facts(nvcc_version="11.3", torch_cuda="11.8", torch_version="2.1.2+cu118"))
    assert worst("env.nvcc", f) is Severity.FAIL
    assert "11.4" in text("env.nvcc", f)


def test_nvcc13_cannot_target_volta() -> None:
    f = facts(
        env_facts(torch_cuda="13.0", torch_version="2.9.0+cu130", nvcc_version="13.0", gpus=(V100,))
    )
    assert worst("env.nvcc", f) is Severity.FAIL
    assert "Unsupported gpu architecture 'compute_70'" in text("env.nvcc", f)


def test_nvcc_older_than_the_gpu_warns() -> None:
    f = facts(
        env_facts(
            nvcc_version="11.4", torch_cuda="11.4", torch_version="1.12.1+cu114", gpus=(H100,)
        )
    )
    assert worst("env.nvcc", f) is Severity.WARN
    assert "PTX" in text("env.nvcc", f)


def test_nvcc_absent_or_broken() -> None:
    assert worst("env.nvcc", facts(env_facts(nvcc_version=None, nvcc_path=None))) is Severity.SKIP
    f = facts(env_facts(nvcc_version=None, nvcc_error="`/x/bin/nvcc --version` exited 127"))
    assert worst("env.nvcc", f) is Severity.FAIL
    assert worst("env.nvcc", facts(cpu_env())) is Severity.SKIP


# ---------------------------------------------------------------------------------------
# env.host_compiler


def test_host_compiler_ok() -> None:
    assert worst("env.host_compiler", facts()) is Severity.OK


def test_gcc_too_new_for_nvcc() -> None:
    gcc13 = CompilerInfo("gcc", "/usr/bin/gcc", "gcc", "13.2.0")
    f = facts(env_facts(nvcc_host=gcc13))
    assert worst("env.host_compiler", f) is Severity.FAIL
    t = text("env.host_compiler", f)
    assert "unsupported GNU version" in t and "CC=gcc-12" in t
    # the same gcc is fine for nvcc 12.4 (its host_config.h allows gcc 13)
    ok13 = facts(
        env_facts(nvcc_host=gcc13, nvcc_version="12.4", nvcc_max_gcc=13, torch_cuda="12.4")
    )
    assert worst("env.host_compiler", ok13) is Severity.OK


def test_gcc_limit_from_table_when_header_unreadable() -> None:
    gcc13 = CompilerInfo("gcc", "/usr/bin/gcc", "gcc", "13.2.0")
    assert (
        worst("env.host_compiler", facts(env_facts(nvcc_host=gcc13, nvcc_max_gcc=None)))
        is Severity.FAIL
    )
    gcc12 = CompilerInfo("gcc", "/usr/bin/gcc", "gcc", "12.3.0")
    assert (
        worst("env.host_compiler", facts(env_facts(nvcc_host=gcc12, nvcc_max_gcc=None)))
        is Severity.OK
    )
    # CUDA 11.4.0 (V11.4.48) stopped at gcc 10
    gcc11 = CompilerInfo("gcc", "/usr/bin/gcc", "gcc", "11.4.0")
    old = env_facts(
        nvcc_host=gcc11,
        nvcc_max_gcc=None,
        nvcc_version="11.4",
        nvcc_build="V11.4.48",
        torch_cuda="11.4",
    )
    assert worst("env.host_compiler", facts(old)) is Severity.FAIL


def test_clang_too_new() -> None:
    clang = CompilerInfo("clang", "/usr/bin/clang", "clang", "17.0.6")
    assert (
        worst("env.host_compiler", facts(env_facts(nvcc_host=clang, nvcc_max_clang=16)))
        is Severity.FAIL
    )
    assert (
        worst("env.host_compiler", facts(env_facts(nvcc_host=clang, nvcc_max_clang=None)))
        is Severity.INFO
    )


def test_no_cxx_compiler() -> None:
    f = facts(cpu_env(cxx=CompilerInfo("c++", None, error="`c++` is not on PATH")))
    assert worst("env.host_compiler", f) is Severity.FAIL
    assert "g++" in text("env.host_compiler", f)


def test_cpu_torch_ignores_nvcc_limits() -> None:
    gcc14 = CompilerInfo("gcc", "/usr/bin/gcc", "gcc", "14.1.0")
    assert worst("env.host_compiler", facts(cpu_env(nvcc_host=gcc14, cxx=gcc14))) is Severity.OK


def test_max_gcc_table() -> None:
    from qwen_kvprep.checks.env import max_gcc_for

    assert max_gcc_for((11, 8)) == 11
    assert max_gcc_for((12, 1)) == 12
    assert max_gcc_for((12, 4)) == 13
    assert max_gcc_for((12, 8)) == 14
    assert max_gcc_for((13, 0)) == 15
    assert max_gcc_for((11, 4), "V11.4.48") == 10


def test_parse_host_config() -> None:
    header = (
        "#if __GNUC__ > 15\n#error -- unsupported GNU version!\n#endif\n"
        "#error -- unsupported clang version! clang version must be less than 21 and "
        "greater than 3.2 ."
    )
    assert parse_host_config(header) == (15, 20)
    assert parse_host_config("nothing here") == (None, None)


def test_parse_compiler_versions() -> None:
    assert parse_compiler_version(
        "c++ (Debian 12.2.0-14+deb12u1) 12.2.0\nCopyright (C) 2022 Free Software Foundation"
    ) == ("gcc", "12.2.0")
    assert parse_compiler_version("gcc (GCC) 4.8.5 20150623 (Red Hat 4.8.5-44)\n") == (
        "gcc",
        "4.8.5",
    )
    assert parse_compiler_version("Ubuntu clang version 17.0.6 (9ubuntu1)\nTarget: x86_64") == (
        "clang",
        "17.0.6",
    )
    assert parse_nvcc_version("Cuda compilation tools, release 12.1, V12.1.105\n") == (
        "12.1",
        "V12.1.105",
    )


# ---------------------------------------------------------------------------------------
# env.ninja / env.python_headers


def test_ninja() -> None:
    assert worst("env.ninja", facts()) is Severity.OK
    hidden = facts(env_facts(ninja_path=None, ninja_beside_python="/venv/bin/ninja"))
    assert worst("env.ninja", hidden) is Severity.FAIL
    assert 'export PATH="/venv/bin:$PATH"' in text("env.ninja", hidden)
    none = facts(env_facts(ninja_path=None, ninja_beside_python=None))
    assert worst("env.ninja", none) is Severity.FAIL
    assert "pip install ninja" in text("env.ninja", none)
    prebuilt = facts(
        env_facts(ninja_path=None, ninja_beside_python=None), cache=caches(builds=(build(),))
    )
    assert worst("env.ninja", prebuilt) is Severity.WARN


def test_python_headers() -> None:
    assert worst("env.python_headers", facts()) is Severity.OK
    f = facts(env_facts(python_h=False))
    assert worst("env.python_headers", f) is Severity.FAIL
    t = text("env.python_headers", f)
    assert "Python.h: No such file" in t and "python3.11-dev" in t


# ---------------------------------------------------------------------------------------
# env.transformers / remote requirements / flash-attn / GPTQ


@pytest.mark.parametrize(
    ("version", "expected", "symptom"),
    [
        ("4.31.0", Severity.FAIL, "generate()"),
        ("4.32.0", Severity.OK, ""),
        ("4.37.2", Severity.OK, ""),
        ("4.53.3", Severity.OK, "4.38"),
        ("4.54.1", Severity.FAIL, "TypeError: 'NoneType' object is not subscriptable"),
        ("4.55.4", Severity.FAIL, "TypeError: 'NoneType' object is not subscriptable"),
        ("4.54.0.dev0", Severity.FAIL, "TypeError"),
        ("4.57.1", Severity.FAIL, "cannot import name 'BeamSearchScorer'"),
        ("5.0.0", Severity.FAIL, "DisjunctiveConstraint"),
        ("5.23.0", Severity.FAIL, "DisjunctiveConstraint"),
    ],
)
def test_transformers_matrix(version: str, expected: Severity, symptom: str) -> None:
    f = facts(env_facts(transformers_version=version))
    assert worst("env.transformers", f) is expected
    assert symptom in text("env.transformers", f)
    if expected is Severity.FAIL:
        assert 'pip install "transformers>=4.32,<4.54"' in text("env.transformers", f)


def test_transformers_missing() -> None:
    assert worst("env.transformers", facts(env_facts(transformers_version=None))) is Severity.FAIL


def test_remote_requirements() -> None:
    assert worst("env.remote_requirements", facts()) is Severity.OK
    f = facts(env_facts(packages=_pkgs(einops=None, transformers_stream_generator=None)))
    assert worst("env.remote_requirements", f) is Severity.FAIL
    t = text("env.remote_requirements", f)
    assert "requires the following packages that were not found" in t
    assert "pip install einops transformers_stream_generator" in t
    # with a checkpoint its own imports are checked (checkpoint.requirements): said once
    probed = ckpt(requirements=("torch", "einops"))
    assert (
        worst("env.remote_requirements", dataclasses.replace(f, checkpoint=probed)) is Severity.SKIP
    )


def test_flash_attn_conflict() -> None:
    fa = env_facts(packages=_pkgs(flash_attn="2.5.6"))
    auto = ckpt(
        config={"use_cache_quantization": True, "use_cache_kernel": True, "use_flash_attn": "auto"}
    )
    f = facts(fa, checkpoint=auto)
    assert worst("env.flash_attn", f) is Severity.FAIL
    assert "'tuple' object has no attribute 'dtype'" in text("env.flash_attn", f)
    missing_key = ckpt(config={"use_cache_quantization": True, "use_cache_kernel": True})
    assert worst("env.flash_attn", facts(fa, checkpoint=missing_key)) is Severity.FAIL
    assert (
        worst("env.flash_attn", facts(fa, checkpoint=ckpt())) is Severity.OK
    )  # use_flash_attn false
    assert worst("env.flash_attn", facts(checkpoint=auto)) is Severity.OK  # not installed
    off = ckpt(config={"use_flash_attn": "auto"})
    assert worst("env.flash_attn", facts(fa, checkpoint=off)) is Severity.INFO
    cpu = cpu_env(packages=_pkgs(flash_attn="2.5.6"))
    assert worst("env.flash_attn", facts(cpu, checkpoint=auto)) is Severity.WARN
    assert worst("env.flash_attn", facts(fa)) is Severity.INFO  # no checkpoint


def test_gptq_packages() -> None:
    assert worst("env.gptq", facts(checkpoint=ckpt())) is Severity.SKIP
    f = facts(checkpoint=ckpt(gptq=True))
    assert worst("env.gptq", f) is Severity.FAIL
    assert "pip install optimum auto-gptq" in text("env.gptq", f)
    both = env_facts(packages=_pkgs(optimum="1.16.1", auto_gptq="0.6.0"))
    assert worst("env.gptq", facts(both, checkpoint=ckpt(gptq=True))) is Severity.OK
    gptqmodel = env_facts(packages=_pkgs(optimum="1.23.0", gptqmodel="1.4.0"))
    assert worst("env.gptq", facts(gptqmodel, checkpoint=ckpt(gptq=True))) is Severity.OK


# ---------------------------------------------------------------------------------------
# build.cache / build.arch


def test_build_cache() -> None:
    assert worst("build.cache", facts(cache=caches())) is Severity.OK
    ro = FolderAccess(
        "/ro/cache", "default", True, False, "/ro/cache", "/ro/cache is on a read-only file system"
    )
    f = facts(cache=caches(build_cache=ro))
    assert worst("build.cache", f) is Severity.FAIL
    t = text("build.cache", f)
    assert "/ro/cache" in t and "--cache-dir" in t and "QWEN_KVPREP_CACHE" in t
    assert (
        worst("build.cache", facts(cache=caches(build_cache=ro, builds=(build(),))))
        is Severity.WARN
    )


def test_h100_with_extension_built_for_sm80_only() -> None:
    f = facts(env_facts(gpus=(H100,)), cache=caches(builds=(build(("sm_80",)),)))
    assert worst("build.arch", f) is Severity.FAIL
    t = text("build.arch", f)
    assert "no kernel image is available" in t
    assert 'qwen-kvprep build --arch "9.0"' in t


def test_build_arch_cases() -> None:
    a100 = facts(env_facts(gpus=(A100,)), cache=caches(builds=(build(("sm_80",)),)))
    assert worst("build.arch", a100) is Severity.OK
    a10 = facts(
        env_facts(gpus=(GpuInfo(0, "NVIDIA A10", (8, 6)),)),
        cache=caches(builds=(build(("sm_80",)),)),
    )
    assert worst("build.arch", a10) is Severity.OK  # SASS runs on a later minor
    ptx = facts(env_facts(gpus=(H100,)), cache=caches(builds=(build(("sm_80", "compute_80")),)))
    assert worst("build.arch", ptx) is Severity.INFO
    arch_specific = facts(
        env_facts(gpus=(GpuInfo(0, "B200", (10, 0)),)), cache=caches(builds=(build(("sm_90a",)),))
    )
    assert worst("build.arch", arch_specific) is Severity.FAIL
    cpu_only = facts(env_facts(gpus=(A100,)), cache=caches(builds=(build(cuda=False),)))
    assert worst("build.arch", cpu_only) is Severity.FAIL
    unreadable = BuildRecord(
        "/c/b/k",
        "k1",
        build().manifest,
        "/c/b/k/x.so",
        True,
        BinaryArchs("/c/b/k/x.so", error="not an ELF shared object"),
    )
    assert worst("build.arch", facts(cache=caches(builds=(unreadable,)))) is Severity.WARN
    assert (
        worst("build.arch", facts(env_facts(gpus=()), cache=caches(builds=(build(),))))
        is Severity.INFO
    )
    assert worst("build.arch", facts(env_facts(gpus=()), cache=caches())) is Severity.SKIP
    assert worst("build.arch", facts(cache=caches())) is Severity.INFO  # GPU, no build yet


def test_build_arch_manifest_claims_what_the_binary_lacks() -> None:
    # The loader picks this build for a 9.0 GPU by its manifest; the binary has no sm_90.
    liar = build(("sm_80",), arch_list=["8.0", "9.0"])
    f = facts(env_facts(gpus=(H100,)), cache=caches(builds=(liar,)))
    assert worst("build.arch", f) is Severity.FAIL
    assert "claims 9.0" in text("build.arch", f)


def test_build_arch_judges_each_gpu_by_the_build_the_loader_picks() -> None:
    two = caches(builds=(build(("sm_80",), key="for80"), build(("sm_90",), key="for90")))
    gpus = (A100, dataclasses.replace(H100, index=1))
    found = run("build.arch", facts(env_facts(gpus=gpus), cache=two))
    assert [x.severity for x in found] == [Severity.OK, Severity.OK]
    assert "for80" in found[0].message and "for90" in found[1].message
    # builds of other kernel sources are not what the loader takes
    other = dataclasses.replace(
        build(("sm_90",), key="othersrc"),
        manifest=dict(
            build().manifest, inputs=dict(build(("sm_90",)).manifest["inputs"], sources={"x": "y"})
        ),
    )
    f = facts(env_facts(gpus=(H100,)), checkpoint=ckpt(), cache=caches(builds=(other,)))
    assert worst("build.arch", f) is Severity.INFO  # no build for these sources yet


def test_build_arch_reads_original_jit_build_in_modules_cache() -> None:
    # Qwen's cpp_kernels.py with nvcc 12.1 builds sm_70 + sm_80 only: an H100 gets nothing.
    jit = BinaryArchs(
        "/hf/modules/transformers_modules/Qwen-7B-Chat/build/cache_autogptq_cuda_256.so",
        tuple(e for e in (parse_arch_label("sm_70"), parse_arch_label("sm_80")) if e),
    )
    f = facts(
        env_facts(gpus=(H100,)),
        checkpoint=ckpt(),
        cache=caches(module_folders=(folder(jit_builds=(jit,)),)),
    )
    assert worst("build.arch", f) is Severity.FAIL


def test_runs_on_rules() -> None:
    sm80, sm86, c80, sm90a, c90a = (
        parse_arch_label(x) for x in ("sm_80", "sm_86", "compute_80", "sm_90a", "compute_90a")
    )
    assert sm80 and sm86 and c80 and sm90a and c90a
    assert runs_on([sm80], (8, 6)) == sm80
    assert runs_on([sm86], (8, 0)) is None
    assert runs_on([sm80], (9, 0)) is None
    assert runs_on([sm80, c80], (9, 0)) == c80
    assert runs_on([c80, sm80], (8, 0)) == sm80  # SASS preferred over PTX
    assert runs_on([sm90a], (9, 0)) == sm90a
    assert runs_on([sm90a, c90a], (10, 0)) is None
    assert parse_arch_label("compute_120").capability == (12, 0)  # type: ignore[union-attr]
    assert parse_arch_label("bogus") is None


def test_usable_builds_matches_torch_abi_and_python() -> None:
    env = env_facts()
    c = caches(
        builds=(build(key="a", torch="2.0.1+cu118"), build(key="b"), build(key="c", cuda=False))
    )
    assert [b.key for b in usable_builds(c, env)] == ["b", "c"]
    pinned = dataclasses.replace(c, state={"build": {"key": "c"}})
    assert usable_builds(pinned, env)[0].key == "c"
    wrong_py = dataclasses.replace(c, python_tag="cp310")
    assert usable_builds(wrong_py, env) == []
    assert usable_builds(None, env) == []


NVCC = shutil.which("nvcc") or next(
    (
        str(p)
        for p in (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc",)
        if p.is_file()
    ),
    None,
)

_TINY_CU = """
__global__ void add1(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}
extern "C" void launch(float* x, int n) { add1<<<(n + 127) / 128, 128>>>(x, n); }
"""


@pytest.fixture(scope="module")
def real_fatbins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny .cu compiled by nvcc (no GPU needed): sm_80 only, and sm_80 + PTX 8.0."""
    if NVCC is None:
        needs.skip("nvcc", "no nvcc on this machine")
    d = tmp_path_factory.mktemp("fatbin")
    (d / "k.cu").write_text(_TINY_CU)
    out = {}
    for name, flags in (
        ("sm80.so", ["-gencode", "arch=compute_80,code=sm_80"]),
        ("sm80_ptx.so", ["-gencode", "arch=compute_80,code=[sm_80,compute_80]"]),
    ):
        res = subprocess.run(
            [NVCC, "-shared", "-Xcompiler", "-fPIC", *flags, "k.cu", "-o", name],
            cwd=d,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if res.returncode != 0:
            needs.skip("nvcc", f"nvcc could not build the test kernel: {res.stderr[-500:]}")
        out[name] = d / name
    return out


def test_read_archs_from_a_real_fatbin(real_fatbins: dict[str, Path]) -> None:
    only = read_archs(real_fatbins["sm80.so"])
    assert only.error is None
    assert only.labels() == ["sm_80"]
    assert runs_on(only.entries, (9, 0)) is None
    assert runs_on(only.entries, (8, 6)) == CodeEntry(80, "sass")
    both = read_archs(real_fatbins["sm80_ptx.so"])
    assert both.labels() == ["compute_80", "sm_80"]
    assert runs_on(both.entries, (9, 0)) == CodeEntry(80, "ptx")


def test_probe_and_check_a_real_build_for_sm80_on_an_h100(
    real_fatbins: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    bdir = cache / "builds" / "k1"
    bdir.mkdir(parents=True)
    shutil.copy(real_fatbins["sm80.so"], bdir / "cache_autogptq_cuda_256.so")
    manifest = dict(build().manifest)
    (bdir / "manifest.json").write_text(__import__("json").dumps(manifest))
    probed = probe_caches(None, cache_dir=cache, environ={"HF_MODULES_CACHE": str(tmp_path / "m")})
    assert [b.archs.labels() if b.archs else None for b in probed.builds] == [["sm_80"]]
    probed = dataclasses.replace(probed, python_tag="cp311", machine="linux-x86_64")
    found = run("build.arch", facts(env_facts(gpus=(H100,)), cache=probed))
    assert [x.severity for x in found] == [Severity.FAIL]
    assert "no kernel image is available" in found[0].message
    assert (
        run("build.arch", facts(env_facts(gpus=(A100,)), cache=probed))[0].severity is Severity.OK
    )
    # a manifest that claims 9.0 does not make the sm_80 binary run there
    manifest["inputs"] = dict(manifest["inputs"], arch_list=["8.0", "9.0"])
    (bdir / "manifest.json").write_text(__import__("json").dumps(manifest))
    probed = dataclasses.replace(
        probe_caches(None, cache_dir=cache, environ={"HF_MODULES_CACHE": str(tmp_path / "m")}),
        python_tag="cp311",
        machine="linux-x86_64",
    )
    found = run("build.arch", facts(env_facts(gpus=(H100,)), cache=probed))
    assert [x.severity for x in found] == [Severity.FAIL]
    assert "claims 9.0" in found[0].message


def test_read_archs_on_non_elf_and_missing(tmp_path: Path) -> None:
    (tmp_path / "x.so").write_bytes(b"not an elf")
    assert read_archs(tmp_path / "x.so").error == "not an ELF shared object"
    assert read_archs(tmp_path / "missing.so").error is not None
    (tmp_path / "empty.so").write_bytes(b"")
    assert read_archs(tmp_path / "empty.so").error is not None


def test_read_archs_cpu_extension_has_no_device_code() -> None:
    # Any ELF without a fatbin section (here: the Python interpreter's own binary).
    b = read_archs(Path(os.path.realpath(sys.executable)))
    assert b.error is None and b.entries == ()


# ---------------------------------------------------------------------------------------
# modules.cache / modules.folder / modules.stale_lock


def test_modules_cache() -> None:
    assert worst("modules.cache", facts(cache=caches())) is Severity.OK
    ro = FolderAccess(
        "/hf/modules",
        "HF_HOME",
        True,
        False,
        "/hf/modules",
        "/hf/modules is on a read-only file system",
    )
    f = facts(cache=caches(modules_root=ro, module_folders=(folder(sources=False),)))
    assert worst("modules.cache", f) is Severity.FAIL
    assert "HF_MODULES_CACHE" in text("modules.cache", f)
    assert worst("modules.cache", facts(cache=caches(modules_root=ro))) is Severity.WARN


def test_modules_folder_ok() -> None:
    assert worst("modules.folder", facts(checkpoint=ckpt(), cache=caches())) is Severity.OK


def test_modules_folder_missing_sources_means_silent_fallback() -> None:
    f = facts(checkpoint=ckpt(), cache=caches(module_folders=(folder(sources=False),)))
    assert worst("modules.folder", f) is Severity.FAIL
    t = text("modules.folder", f)
    assert "KV cache kernel source files (.cpp and .cu) not found." in t
    assert "qwen-kvprep fix /models/Qwen-7B-Chat" in t
    off = ckpt(config={"use_cache_quantization": False})
    assert (
        worst(
            "modules.folder",
            facts(checkpoint=off, cache=caches(module_folders=(folder(sources=False),))),
        )
        is Severity.INFO
    )


def test_modules_folder_absent_before_first_load_is_info() -> None:
    f = facts(checkpoint=ckpt(), cache=caches(module_folders=(folder(exists=False),)))
    assert worst("modules.folder", f) is Severity.INFO
    planted_elsewhere = caches(
        module_folders=(folder(exists=False),),
        state={"modules": {"folder": "/build-time/hf/modules/transformers_modules/Qwen-7B-Chat"}},
    )
    assert (
        worst("modules.folder", facts(checkpoint=ckpt(), cache=planted_elsewhere)) is Severity.WARN
    )


def test_modules_folder_stale_sources_and_original_loader() -> None:
    stale = ckpt(kernel_sources={n: "d" * 64 for n in KERNEL_FILES})
    assert worst("modules.folder", facts(checkpoint=stale, cache=caches())) is Severity.WARN
    original = caches(module_folders=(folder(loader=False),))
    f = facts(checkpoint=ckpt(loader_is_ours=False), cache=original)
    assert worst("modules.folder", f) is Severity.FAIL
    assert "FileNotFoundError" in text("modules.folder", f)
    # the checkpoint already has our loader: transformers refreshes the copy at next load
    assert worst("modules.folder", facts(checkpoint=ckpt(), cache=original)) is Severity.INFO
    assert (
        worst(
            "modules.folder",
            facts(checkpoint=ckpt(), cache=caches(module_folders=(folder(loader=None),))),
        )
        is Severity.INFO
    )


def test_stale_lock_findings() -> None:
    assert worst("modules.stale_lock", facts(cache=caches())) is Severity.OK
    path = "/hf/modules/transformers_modules/Qwen-7B-Chat/build/lock"
    stale = facts(cache=caches(locks=(LockFile(path, 3600.0),)))
    assert worst("modules.stale_lock", stale) is Severity.FAIL
    assert f"rm -f {path}" in text("modules.stale_lock", stale)
    held = facts(cache=caches(locks=(LockFile(path, 5.0, ((4242, "python serve.py"),)),)))
    assert worst("modules.stale_lock", held) is Severity.INFO
    assert "4242" in text("modules.stale_lock", held)
    unsure = facts(cache=caches(locks=(LockFile(path, 5.0, (), unreadable=3),)))
    assert worst("modules.stale_lock", unsure) is Severity.WARN


def test_lock_probe_sees_a_live_holder_and_a_stale_lock(tmp_path: Path) -> None:
    root = tmp_path / "modules"
    lock = root / "transformers_modules" / "Qwen-7B-Chat" / "build" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; f=open(sys.argv[1]); print('ready', flush=True); time.sleep(60)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        probed = probe_caches(
            None, environ={"HF_MODULES_CACHE": str(root)}, cache_dir=tmp_path / "c"
        )
        assert [lk.path for lk in probed.locks] == [str(lock)]
        assert holder.pid in [pid for pid, _ in probed.locks[0].holders]
        assert worst("modules.stale_lock", facts(cache=probed)) is Severity.INFO
    finally:
        holder.kill()
        holder.wait()
    probed = probe_caches(None, environ={"HF_MODULES_CACHE": str(root)}, cache_dir=tmp_path / "c")
    assert probed.locks[0].holders == ()
    if probed.locks[0].unreadable == 0:
        assert worst("modules.stale_lock", facts(cache=probed)) is Severity.FAIL


def test_open_file_holders_without_proc(tmp_path: Path) -> None:
    holders, unreadable = open_file_holders([tmp_path / "x"], proc=tmp_path / "no-proc")
    assert holders == {str(tmp_path / "x"): []} and unreadable == -1


# ---------------------------------------------------------------------------------------
# probes on this machine: never raise, never write


def test_resolve_cuda_home_mirrors_torch() -> None:
    assert resolve_cuda_home({"CUDA_HOME": "/a:/b"}, "/usr/bin/nvcc") == ("/a:/b", "CUDA_HOME")
    assert resolve_cuda_home({"CUDA_PATH": "/opt/cuda"}, None) == ("/opt/cuda", "CUDA_PATH")
    assert resolve_cuda_home({}, "/usr/local/bin/nvcc") == ("/usr/local", "nvcc-on-path")


def test_version_tuple() -> None:
    assert version_tuple("2.1.0+cu121") == (2, 1, 0)
    assert version_tuple("4.54.0.dev0") == (4, 54, 0)
    assert version_tuple("junk") is None and version_tuple(None) is None


def test_module_folder_naming(tmp_path: Path) -> None:
    root, source = modules_cache_root({"HF_HOME": "/hf"})
    assert (root, source) == (Path("/hf/modules"), "HF_HOME")
    assert modules_cache_root({"HF_MODULES_CACHE": "/m", "HF_HOME": "/hf"})[0] == Path("/m")
    assert modules_cache_root({"XDG_CACHE_HOME": "/x"})[0] == Path("/x/huggingface/modules")
    snap = Path("/hub/models--Qwen--Qwen-7B-Chat/snapshots/abc123")
    names = [str(p) for p, _ in module_folder_candidates(snap, Path("/m"))]
    assert names == [
        "/m/transformers_modules/abc123",
        "/m/transformers_modules/Qwen/Qwen-7B-Chat/abc123",
    ]


def test_folder_access_without_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert folder_access(tmp_path / "new" / "deeper", "x").writable
    (tmp_path / "file").write_text("")
    blocked = folder_access(tmp_path / "file" / "sub", "x")
    assert not blocked.writable and "is a file" in (blocked.reason or "")
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    denied = folder_access(tmp_path, "x")
    assert not denied.writable and str(tmp_path) in (denied.reason or "")
    assert not (tmp_path / "new").exists()


def test_probe_env_here_never_raises() -> None:
    from qwen_kvprep.probe.env import probe_env

    env = probe_env()
    assert env.python_version.startswith(f"{sys.version_info[0]}.{sys.version_info[1]}")
    assert env.torch_version is not None or env.torch_error
    assert set(env.packages) >= {
        "tiktoken",
        "einops",
        "transformers_stream_generator",
        "flash_attn",
    }


# ---------------------------------------------------------------------------------------
# a crashing check and the redaction helpers


def test_a_crashing_check_is_its_own_failing_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(f: Facts) -> None:
        raise RuntimeError("deliberate")

    monkeypatch.setitem(REGISTRY, "env.zz_boom", Check("env.zz_boom", "boom", boom))
    found = run_checks(facts(), ["env.python", "env.zz_boom", "env.torch"])
    by_id = {f.id: f for f in found}
    assert by_id["env.zz_boom"].severity is Severity.FAIL
    assert "crashed: RuntimeError: deliberate" in by_id["env.zz_boom"].message
    assert (
        by_id["env.python"].severity is Severity.OK and by_id["env.torch"].severity is Severity.OK
    )


def test_checks_on_garbage_facts_crash_into_findings() -> None:
    # A fact of the wrong type must not take the whole doctor down.
    found = run_checks(Facts(env="not EnvFacts", caches=42), MY_CHECKS)  # type: ignore[arg-type]
    assert {f.id for f in found} == set(MY_CHECKS)


def test_scrub() -> None:
    from qwen_kvprep.redact import scrub, scrub_finding

    env = {
        "HF_TOKEN": "hf_" + "a" * 34,
        "MY_API_KEY": "s3cr3t-value",
        "SHORT_KEY": "1",
        "PATH": "/usr/bin",
    }
    masked = scrub(
        "token hf_" + "a" * 34 + " in /data/s3cr3t-value/x and hf_" + "B" * 31 + " v1.2", env
    )
    assert "a" * 34 not in masked and "s3cr3t-value" not in masked and "B" * 31 not in masked
    assert "v1.2" in masked  # a 1-character "secret" is not masked everywhere
    f = Finding(
        "env.x",
        Severity.FAIL,
        "at /data/s3cr3t-value",
        "rm /data/s3cr3t-value",
        ("/data/s3cr3t-value",),
        {"p": ["/data/s3cr3t-value"]},
    )
    g = scrub_finding(f, env)
    assert "s3cr3t-value" not in repr(g)


def test_report_markdown_has_versions_and_no_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    from qwen_kvprep.render import report_markdown

    token = "hf_" + "Z" * 36
    monkeypatch.setenv("HF_TOKEN", token)
    env = env_facts(
        env_vars={"HF_HOME": f"/home/u/{token}/hf", "CUDA_HOME": "/usr/local/cuda-12.1"}
    )
    found = run_checks(facts(env, checkpoint=ckpt(), cache=caches()), MY_CHECKS)
    md = report_markdown(facts(env, checkpoint=ckpt(), cache=caches()), found)
    assert token not in md
    assert "HF_TOKEN" in md  # named as set, value hidden
    for needle in (
        "2.1.2+cu121",
        "NVIDIA A100",
        "4.37.2",
        "12.1",
        "use_cache_quantization",
        "env.nvcc",
    ):
        assert needle in md, needle
