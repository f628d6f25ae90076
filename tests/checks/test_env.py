"""The env. checks on made-up facts, each with its ok and its not-ok cases, and the env
probe's parsers and its run on this machine."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

import pytest

from qwen_kvprep.common import GPTQ_CURRENT, GPTQ_LEGACY, gptq_install
from qwen_kvprep.findings import Severity
from qwen_kvprep.probe.env import (
    CompilerInfo,
    parse_compiler_version,
    parse_host_config,
    parse_nvcc_version,
    resolve_cuda_home,
    version_tuple,
)
from tests.checks.facts import (
    A100,
    H100,
    P100,
    RTX5090,
    V100,
    build,
    caches,
    ckpt,
    cpu_env,
    env_facts,
    facts,
    packages,
    run,
    text,
    usr_local,
    worst,
)

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


def test_cuda_home_usr_local_trap() -> None:
    f = facts(usr_local(), checkpoint=ckpt(loader_is_ours=False))
    assert worst("env.cuda_home", f) is Severity.FAIL
    t = text("env.cuda_home", f)
    assert "-lcudart" in t and "/usr/local/bin/nvcc" in t
    assert "export CUDA_HOME=/usr/local/cuda-12.1" in t
    # qwen-kvprep's own builder steps over the wrapper: only torch's JIT path is broken
    assert worst("env.cuda_home", facts(usr_local(), checkpoint=ckpt())) is Severity.WARN
    assert worst("env.cuda_home", facts(usr_local(cuda_candidates=()))) is Severity.FAIL


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
        ("4.54.1", Severity.OK, "compatibility module"),
        ("4.55.4", Severity.OK, "compatibility module"),
        ("4.54.0.dev0", Severity.OK, "compatibility module"),
        ("4.57.1", Severity.OK, "compatibility module"),
        # Qwen's tokenizer, measured on every 5.x minor release (checks/measured.py)
        ("5.0.0", Severity.WARN, "measured on 5.0.0"),
        ("5.1.0", Severity.WARN, "measured on 5.1.0"),
        ("5.2.0", Severity.OK, "compatibility module"),
        ("5.17.0", Severity.OK, "compatibility module"),
        ("5.22.2", Severity.OK, "compatibility module"),
        ("5.23.0", Severity.OK, "compatibility module"),
        ("5.24.0", Severity.OK, "other weights than the checkpoint's"),
        ("5.99.0", Severity.OK, "compatibility module"),  # newer than measured: not judged
    ],
)
def test_transformers_matrix(version: str, expected: Severity, symptom: str) -> None:
    f = facts(env_facts(transformers_version=version))
    assert worst("env.transformers", f) is expected
    assert symptom in text("env.transformers", f)
    if expected is Severity.FAIL:
        assert 'pip install -U "transformers>=4.32"' in text("env.transformers", f)
    if expected is Severity.WARN:
        assert 'pip install -U "transformers>=5.2"' in text("env.transformers", f)


def test_the_tokenizer_warning_follows_the_measured_table() -> None:
    from qwen_kvprep.checks.measured import QWEN_TOKENIZER

    assert QWEN_TOKENIZER, "nothing measured"
    for (major, minor), (release, how) in QWEN_TOKENIZER.items():
        assert release.startswith(f"{major}.{minor}.")
        f = facts(env_facts(transformers_version=release))
        assert worst("env.transformers", f) is (Severity.OK if how is None else Severity.WARN)


def test_transformers_missing() -> None:
    assert worst("env.transformers", facts(env_facts(transformers_version=None))) is Severity.FAIL


def test_remote_requirements() -> None:
    assert worst("env.remote_requirements", facts()) is Severity.OK
    f = facts(env_facts(packages=packages(einops=None, transformers_stream_generator=None)))
    assert worst("env.remote_requirements", f) is Severity.FAIL
    t = text("env.remote_requirements", f)
    assert "requires the following packages that were not found" in t
    # only chat_stream imports the stream generator, and the fixed folder does without it
    assert "pip install einops" in t and "transformers_stream_generator" not in t
    alone = facts(env_facts(packages=packages(transformers_stream_generator=None)))
    assert worst("env.remote_requirements", alone) is Severity.OK
    # with a checkpoint its own imports are checked (checkpoint.requirements): said once
    probed = ckpt(requirements=("torch", "einops"))
    assert (
        worst("env.remote_requirements", dataclasses.replace(f, checkpoint=probed)) is Severity.SKIP
    )


def test_flash_attn_conflict() -> None:
    fa = env_facts(packages=packages(flash_attn="2.5.6"))
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
    cpu = cpu_env(packages=packages(flash_attn="2.5.6"))
    assert worst("env.flash_attn", facts(cpu, checkpoint=auto)) is Severity.WARN
    assert worst("env.flash_attn", facts(fa)) is Severity.INFO  # no checkpoint


def test_gptq_packages() -> None:
    assert worst("env.gptq", facts(checkpoint=ckpt())) is Severity.SKIP
    f = facts(checkpoint=ckpt(gptq=True))
    assert worst("env.gptq", f) is Severity.FAIL
    assert "optimum is not installed" in text("env.gptq", f)
    assert "no GPTQ backend" in text("env.gptq", f)
    # the command for the stack at hand: it keeps that torch and transformers
    assert f.env is not None
    tf = f.env.package("transformers").version
    assert gptq_install(tf, f.env.torch_version, here=False) in text("env.gptq", f)

    def gptq(**versions: str) -> tuple[Severity, str]:
        pk = {"transformers": "4.53.3", **versions}
        fa = facts(env_facts(packages=packages(**pk)), checkpoint=ckpt(gptq=True))
        return worst("env.gptq", fa), text("env.gptq", fa)

    # the combinations measured (checks/env.py, gptq's docstring)
    for optimum in ("1.24.0", "1.27.0", "2.0.0"):
        assert gptq(optimum=optimum, gptqmodel="2.2.0")[0] is Severity.OK
    sev, msg = gptq(optimum="2.1.0", gptqmodel="2.2.0")
    assert sev is Severity.FAIL and "cannot use gptqmodel 2.2.0" in msg
    assert '"gptqmodel==2.2.0"' in msg and "--no-build-isolation" in msg
    sev, msg = gptq(optimum="1.23.0", gptqmodel="2.2.0")
    assert sev is Severity.FAIL and "optimum 1.23.0 is too old" in msg
    sev, msg = gptq(optimum="1.27.0", gptqmodel="1.4.3")
    assert sev is Severity.FAIL and "gptqmodel 1.4.3 is too old" in msg
    sev, msg = gptq(optimum="1.27.0", gptqmodel="4.2.5")
    assert sev is Severity.FAIL and "needs a newer transformers than 4.53.3" in msg
    # today's stack: the current backend, and the command keeps torch and transformers
    assert gptq(optimum="2.3.0", gptqmodel="7.6.0", transformers="5.24.0")[0] is Severity.OK
    sev, msg = gptq(optimum="2.0.0", gptqmodel="7.6.0", transformers="5.24.0")
    assert sev is Severity.FAIL and "use optimum >= 2.3" in msg
    assert '"transformers==5.24.0"' in msg and f'"torch=={f.env.torch_version}"' in msg
    assert '"gptqmodel>=7"' in msg and "--no-build-isolation" not in msg
    sev, msg = gptq(optimum="1.27.0", gptqmodel="2.2.0", transformers="4.37.2")
    assert sev is Severity.FAIL and "gptqmodel needs transformers >= 4.49" in msg
    sev, msg = gptq(gptqmodel="2.2.0")
    assert sev is Severity.FAIL and "optimum is not installed" in msg
    # the archived backend: it works (with an old peft), said so, not a failure
    sev, msg = gptq(optimum="1.27.0", auto_gptq="0.7.1", peft="0.10.0")
    assert sev is Severity.INFO and "archived" in msg and "peft 0.10.0" in msg
    assert gptq(optimum="1.27.0", auto_gptq="0.4.1")[0] is Severity.FAIL


REPO = Path(__file__).resolve().parents[2]


def test_gptq_install_matches_the_extra() -> None:
    # tomllib is Python >= 3.11 and the oldest CI stage runs 3.9: the extra is one line
    text_ = (REPO / "pyproject.toml").read_text()
    line = re.search(r"^gptq = (\[.*\])$", text_, re.M)
    assert line is not None
    extra = [r.split(";") for r in ast.literal_eval(line.group(1))]
    assert [req for req, marker in extra if ">= '3.10'" in marker] == list(GPTQ_CURRENT)
    assert [req for req, marker in extra if "< '3.10'" in marker] == list(GPTQ_LEGACY)


def test_gptq_install_keeps_the_stack() -> None:
    legacy = gptq_install("4.53.3", "2.13.0", here=False)
    assert '"transformers>=4.49,<4.54"' in legacy and '"gptqmodel==2.2.0"' in legacy
    current = gptq_install("5.24.0", "2.13.0+cpu", here=False)
    assert current == (
        'pip install "optimum>=2.3" "gptqmodel>=7" "torch==2.13.0+cpu" "transformers==5.24.0"'
    )
    # 4.54 to 5.3: no backend fits them; transformers 5 runs Qwen v1 here too
    assert '"transformers>=5.4"' in gptq_install("4.57.6", "2.13.0", here=False)


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
