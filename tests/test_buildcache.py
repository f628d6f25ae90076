"""Build cache units: cache location, keys, architectures, jobs, locks, publishing, failure
diagnosis, the loader template. No compiler runs here: the worker is replaced by a fake
that writes what a real one would (tests/test_e2e_fix.py and test_build_*.py compile)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep import common
from qwen_kvprep.buildcache import (
    CacheLayout,
    builder,
    diagnose,
    jobs,
    lock,
    manifest,
    resolve_cache_dir,
    vendored_sources,
)
from qwen_kvprep.buildcache import arch as archmod
from qwen_kvprep.buildcache.loader import is_loader, render_loader, source_hashes
from qwen_kvprep.errors import BuildError, CacheError, LockTimeout, UsageError
from qwen_kvprep.probe import toolchain

NVCC13 = toolchain.NvccInfo(
    Path("/opt/cuda"),
    Path("/opt/cuda/bin/nvcc"),
    "13.0.88",
    ("7.5", "8.0", "8.6", "8.7", "8.8", "8.9", "9.0", "10.0", "10.3", "11.0", "12.0", "12.1"),
)
NVCC124 = toolchain.NvccInfo(
    Path("/opt/cuda"),
    Path("/opt/cuda/bin/nvcc"),
    "12.4.131",
    ("5.0", "5.2", "6.0", "6.1", "7.0", "7.2", "7.5", "8.0", "8.6", "8.7", "8.9", "9.0"),
)
CUDA_TORCH = toolchain.TorchInfo("2.11.0+cu130", "13.0", True)


# ----------------------------------------------------------------------------- location
def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QWEN_KVPREP_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert resolve_cache_dir(None) == tmp_path / "home" / ".cache" / "qwen-kvprep"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir(None) == tmp_path / "xdg" / "qwen-kvprep"
    monkeypatch.setenv("QWEN_KVPREP_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir(None) == tmp_path / "env"
    assert resolve_cache_dir(tmp_path / "opt") == tmp_path / "opt"


def test_unwritable_cache_names_folder_and_option(tmp_path: Path) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    with pytest.raises(CacheError) as err:
        CacheLayout(blocker).ensure_writable()
    assert str(blocker) in err.value.message
    assert "--cache-dir" in str(err.value.fix) and "QWEN_KVPREP_CACHE" in str(err.value.fix)
    assert err.value.findings[0].id == "build.cache"


# -------------------------------------------------------------------------- architectures
def test_parse_arch_list_forms() -> None:
    assert archmod.parse_arch_list("9.0;8.0", "t") == ("8.0", "9.0")
    assert archmod.parse_arch_list("8.6+PTX 7.5,sm_90a", "t") == ("7.5", "8.6+PTX", "9.0a")
    assert archmod.parse_arch_list("12.0 12.0", "t") == ("12.0",)
    for bad in ("8", "8.0.1", ";;", "abc", "Ampere+PTX", "Amperes"):
        with pytest.raises(UsageError) as err:
            archmod.parse_arch_list(bad, "--arch")
        assert err.value.message.startswith("--arch: ")
        assert err.value.fix is not None and '"8.0;9.0+PTX"' in err.value.fix


def test_parse_arch_list_takes_torch_s_family_names() -> None:
    """TORCH_CUDA_ARCH_LIST may name families, as torch's cpp_extension expands them, in any
    case (the hint names them capitalised; torch only ever gets the capabilities)."""
    assert archmod.parse_arch_list("Ampere", "t") == ("8.0", "8.6+PTX")
    assert archmod.parse_arch_list("ampere", "t") == ("8.0", "8.6+PTX")
    assert archmod.parse_arch_list("HOPPER;volta", "t") == ("7.0+PTX", "9.0+PTX")
    assert archmod.parse_arch_list("ampere+tegra", "t") == ("8.7",)
    assert archmod.parse_arch_list("Volta;Hopper", "t") == ("7.0+PTX", "9.0+PTX")
    assert archmod.parse_arch_list("Kepler+Tesla 8.0", "t") == ("3.7", "8.0")
    assert archmod.parse_arch_list("Ampere 8.0", "t") == ("8.0", "8.6+PTX")


def test_default_list_covers_every_nvcc_arch_with_one_cubin_per_family() -> None:
    assert archmod.family_default(NVCC13.arches) == (
        "7.5",
        "8.0",
        "9.0",
        "10.0",
        "11.0",
        "12.0+PTX",
    )
    # nvcc < 13 still has Volta; nothing older than sm_70 is built
    assert archmod.family_default(NVCC124.arches) == ("7.0", "8.0", "9.0+PTX")
    for nvcc in (NVCC13, NVCC124):
        default = archmod.family_default(nvcc.arches)
        for arch in nvcc.arches:
            cap = toolchain.arch_sort_key(arch)
            assert archmod.covers(default, cap) == (cap >= archmod.MIN_ARCH), arch
        # PTX of the newest family: a GPU newer than this nvcc still runs the kernels
        assert archmod.covers(default, (99, 0))


def test_covers_rules() -> None:
    assert archmod.covers(["8.0"], (8, 6))
    assert not archmod.covers(["8.6"], (8, 0))
    assert not archmod.covers(["8.0"], (9, 0))
    assert archmod.covers(["8.0+PTX"], (9, 0))
    assert not archmod.covers(["9.0a"], (10, 0))
    assert archmod.covers(["9.0a"], (9, 0))


def test_gencode_flags() -> None:
    assert archmod.gencode_flags(["8.0", "9.0+PTX"]) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]


def test_arch_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archmod, "visible_gpu_archs", lambda: ("8.6",))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert archmod.choose_arch_list("8.0", NVCC13) == (("8.0",), "--arch")
    assert archmod.choose_arch_list(None, NVCC13) == (("9.0",), "TORCH_CUDA_ARCH_LIST")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert archmod.choose_arch_list(None, NVCC13)[0] == ("8.6",)
    monkeypatch.setattr(archmod, "visible_gpu_archs", lambda: ())
    arches, origin = archmod.choose_arch_list(None, NVCC13)
    assert arches == archmod.family_default(NVCC13.arches) and "default" in origin


def test_arch_nvcc_cannot_compile_is_refused_before_building() -> None:
    with pytest.raises(BuildError) as err:
        archmod.choose_arch_list("7.0;8.0", NVCC13)
    assert "7.0" in err.value.message and "13.0.88" in err.value.message
    assert err.value.findings[0].id == "build.arch"


def test_arch_of_compute() -> None:
    assert toolchain.arch_of_compute("compute_121") == "12.1"
    assert toolchain.arch_of_compute("compute_75") == "7.5"
    assert toolchain.arch_of_compute("compute_90a") is None


# ---------------------------------------------------------------------------- jobs
def test_max_jobs_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_JOBS", "3")
    assert jobs.compile_jobs() == (3, "MAX_JOBS=3")


def test_jobs_bounded_by_cgroup_memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MAX_JOBS", raising=False)
    # v2: the limit sits on an ancestor of our cgroup
    (tmp_path / "kube" / "pod").mkdir(parents=True)
    (tmp_path / "kube" / "memory.max").write_text(str(3 * 2**30))
    (tmp_path / "kube" / "pod" / "memory.max").write_text("max")
    monkeypatch.setattr(jobs, "_own_cgroup_paths", lambda: [("", "/kube/pod")])
    assert jobs.cgroup_memory_limit(tmp_path) == 3 * 2**30
    # v1: memory controller, unlimited reported as a huge number
    v1 = tmp_path / "v1"
    (v1 / "memory" / "ctr").mkdir(parents=True)
    (v1 / "memory" / "ctr" / "memory.limit_in_bytes").write_text(str(2**30))
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")
    monkeypatch.setattr(jobs, "_own_cgroup_paths", lambda: [("memory", "/ctr")])
    assert jobs.cgroup_memory_limit(v1) == 2**30
    monkeypatch.setattr(jobs, "cgroup_memory_limit", lambda: 2 * 2**30)
    monkeypatch.setattr(jobs, "_cpus", lambda: 16)
    n, why = jobs.compile_jobs()
    assert n == 1 and "16 CPU" in why and "2.0 GiB" in why


# ---------------------------------------------------------------------------- diagnosis
LOG_GNU = """[1/3] /usr/local/cuda/bin/nvcc ... -c k.cu -o k.cuda.o
/usr/local/cuda/include/crt/host_config.h:143:2: error: #error -- unsupported GNU version! \
gcc versions later than 12 are not supported!
ninja: build stopped: subcommand failed.
Traceback (most recent call last):
RuntimeError: Error building extension 'cache_autogptq_cuda_256'
"""
LOG_PY_H = "x.cpp:1:10: fatal error: Python.h: No such file or directory\n"
LOG_ARCH = "nvcc fatal   : Unsupported gpu architecture 'compute_70'\n"


def test_first_errors_and_advice() -> None:
    assert diagnose.first_errors(LOG_GNU) == [
        "/usr/local/cuda/include/crt/host_config.h:143:2: error: #error -- unsupported GNU "
        "version! gcc versions later than 12 are not supported!"
    ]
    assert "-ccbin" in diagnose.advice(LOG_GNU)[0]
    assert "python3-dev" in diagnose.advice(LOG_PY_H)[0]
    assert diagnose.first_errors(LOG_ARCH) == [LOG_ARCH.strip()]
    assert "--arch" in diagnose.advice(LOG_ARCH)[0]
    mismatch = (
        "RuntimeError: The detected CUDA version (12.1) mismatches the version that was used "
        "to compile PyTorch (13.0)."
    )
    assert "CUDA_HOME" in diagnose.advice(mismatch)[0]


# ---------------------------------------------------------------------------- planning
def _cuda_plan(monkeypatch: pytest.MonkeyPatch, arch: str = "8.0;9.0", **kw: Any) -> Any:
    monkeypatch.setattr(builder, "torch_info", lambda: kw.get("torch", CUDA_TORCH))
    monkeypatch.setattr(builder, "nvcc_info", lambda: (kw.get("nvcc", NVCC13), "test"))
    return builder.plan_build(kw.get("sources", vendored_sources()), arch)


def _plan_without_nvcc(monkeypatch: pytest.MonkeyPatch) -> Any:
    """This torch's plan with no toolkit found, whatever nvcc this machine has: a CPU-only
    plan, for tests of the cache rather than of the toolchain."""
    monkeypatch.setattr(builder, "nvcc_info", lambda: (None, "no nvcc: the test has none"))
    return builder.plan_build(vendored_sources(), None)


def test_cuda_plan_inputs_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _cuda_plan(monkeypatch)
    assert plan.cuda and plan.arch_list == ("8.0", "9.0")
    inputs = plan.inputs
    assert set(inputs) == set(manifest.INPUT_KEYS)
    assert inputs["torch"] == "2.11.0+cu130" and inputs["nvcc"] == "13.0.88"
    assert "-gencode=arch=compute_90,code=sm_90" in inputs["flags"]["cuda_cflags"]
    assert plan.key == builder.build_key(inputs) == _cuda_plan(monkeypatch).key
    # every ABI input changes the key
    assert _cuda_plan(monkeypatch, arch="8.0").key != plan.key
    other_torch = toolchain.TorchInfo("2.11.0+cu130", "13.0", False)
    assert _cuda_plan(monkeypatch, torch=other_torch).key != plan.key
    src = dict(vendored_sources())
    src["cache_autogptq_cuda_kernel_256.cu"] += b"\n"
    assert _cuda_plan(monkeypatch, sources=src).key != plan.key


# torch.utils.cpp_extension's flags for a compile, as releases spell them (with the
# docstring example 2.11 carries, which names another standard)
CPP_EXTENSION_2_0 = "        cflags = common_cflags + ['-fPIC', '-std=c++17'] + extra_cflags\n"
CPP_EXTENSION_2_11 = (
    "        ...                 extra_compile_args={'cxx': ['-g', '-std=c++20', '-fPIC']})\n"
    "    common_cflags += ['-std=c++17', '-fPIC']\n"
)
CPP_EXTENSION_2_14 = "    common_cflags += ['-std=c++20', '-fPIC']\n"


def test_cxx_standard_follows_torch() -> None:
    # read from torch's own builder when it says
    assert toolchain.cxx_standard("2.11.0+cu130", CPP_EXTENSION_2_11) == "c++17"
    assert toolchain.cxx_standard("2.14.1+cu130", CPP_EXTENSION_2_14) == "c++20"
    assert toolchain.cxx_standard("2.0.1+cu117", CPP_EXTENSION_2_0) == "c++17"
    assert toolchain.cxx_standard("9.9", CPP_EXTENSION_2_11) == "c++17"  # the source wins
    mixed = CPP_EXTENSION_2_0 + CPP_EXTENSION_2_14  # no single answer: the version decides
    assert toolchain.cxx_standard("2.14.1", mixed) == "c++20"
    # else from the version: C++20 from torch 2.12 on (its headers use <compare>)
    for version, std in (("2.0.1", "c++17"), ("2.1.2+cu121", "c++17"), ("2.11.0", "c++17"),
                         ("2.12.1+cu130", "c++20"), ("2.14.1", "c++20"), ("3.0.0", "c++20")):
        assert toolchain.cxx_standard(version, None) == std, version
        assert toolchain.cxx_standard(version, "no flags here") == std, version


def test_installed_torch_standard_matches_its_builder() -> None:
    import torch.utils.cpp_extension as cpp_extension

    text = Path(str(cpp_extension.__file__)).read_text(encoding="utf-8")
    std = toolchain.torch_info().cxx_std
    code = [ln for ln in text.splitlines() if not ln.lstrip().startswith((">>>", "..."))]
    assert any(f"'-std={std}'" in ln for ln in code)
    assert not any("'-std=c++" in ln and f"'-std={std}'" not in ln for ln in code)


@pytest.mark.parametrize(
    ("torch", "std"),
    [(CUDA_TORCH, "c++17"), (toolchain.TorchInfo("2.14.1+cu130", "13.0", True, "c++20"), "c++20")],
)
def test_build_flags_carry_torch_standard(
    monkeypatch: pytest.MonkeyPatch, torch: Any, std: str
) -> None:
    plan = _cuda_plan(monkeypatch, torch=torch)
    assert f"-std={std}" in plan.inputs["flags"]["cflags"]
    assert f"-std={std}" in plan.inputs["flags"]["cuda_cflags"]
    flags = builder.nvcc_compile_flags(torch, plan.arch_list)
    assert flags.count(f"-std={std}") == 1 and "-D_GLIBCXX_USE_CXX11_ABI=1" in flags
    assert "-gencode=arch=compute_90,code=sm_90" in flags
    other = "c++20" if std == "c++17" else "c++17"
    assert _cuda_plan(monkeypatch, torch=replace(torch, cxx_std=other)).key != plan.key


def test_cuda_major_mismatch_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BuildError) as err:
        _cuda_plan(monkeypatch, nvcc=NVCC124)
    assert err.value.findings[0].id == "build.cuda_mismatch"
    assert "CUDA 13.x toolkit" in str(err.value.fix)


def test_cpu_only_said_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builder, "torch_info", lambda: CUDA_TORCH)
    monkeypatch.setattr(builder, "nvcc_info", lambda: (None, "no nvcc: CUDA_HOME is unset"))
    plan = builder.plan_build(vendored_sources(), None)
    assert not plan.cuda and plan.mode.startswith("CPU-only build")
    assert "no nvcc" in plan.mode and plan.inputs["flags"]["cuda_cflags"] == []


# ------------------------------------------------------------ ensure_build, fake worker
@pytest.fixture()
def fake_worker(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace the compiler process: writes a .so and a result like the real worker."""
    behaviour: dict[str, Any] = {"ok": True, "log": "", "calls": 0, "stage": "build"}

    def run(spec_path: Path, log: Any, env: dict[str, str], cwd: Path) -> None:
        behaviour["calls"] += 1
        behaviour["env"] = env
        spec = json.loads(spec_path.read_text())
        log.write(behaviour["log"].encode())
        if behaviour["ok"]:
            so = Path(spec["build_directory"]) / f"{spec['name']}.so"
            so.write_bytes(b"\x7fELF fake extension " + os.urandom(8))
            result = {"ok": True, "so": str(so)}
        else:
            result = {"ok": False, "stage": behaviour["stage"], "error": "RuntimeError: x"}
        Path(spec["result"]).write_text(json.dumps(result))

    monkeypatch.setattr(builder, "_run_worker", run)
    return behaviour


def test_build_published_then_found(
    tmp_path: Path, fake_worker: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = CacheLayout(tmp_path / "cache")
    plan = _plan_without_nvcc(monkeypatch)
    first = builder.ensure_build(plan, layout, notify=lambda m: None)
    assert first.compiled and fake_worker["calls"] == 1
    assert first.dir == layout.build_dir(plan.key) and first.so.is_file()
    data = manifest.read_manifest(first.dir)
    assert data is not None and data["key"] == plan.key and data["inputs"] == plan.inputs
    assert manifest.problem(first.dir, data) is None
    assert (first.dir / "build.log").is_file()
    assert list(layout.tmp.iterdir()) == []  # staging removed
    again = builder.ensure_build(plan, layout, notify=lambda m: None)
    assert not again.compiled and fake_worker["calls"] == 1 and again.so == first.so
    forced = builder.ensure_build(plan, layout, force=True, notify=lambda m: None)
    assert forced.compiled and fake_worker["calls"] == 2
    assert forced.manifest["so_sha256"] != first.manifest["so_sha256"]
    assert list(layout.tmp.iterdir()) == []  # the replaced build is gone too


def test_damaged_build_is_rebuilt(
    tmp_path: Path, fake_worker: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = CacheLayout(tmp_path / "cache")
    plan = _plan_without_nvcc(monkeypatch)
    built = builder.ensure_build(plan, layout, notify=lambda m: None)
    built.so.write_bytes(b"truncated")
    assert builder.find_build(layout, plan.key) is None
    assert builder.ensure_build(plan, layout, notify=lambda m: None).compiled


def test_found_build_needs_no_writable_cache(
    tmp_path: Path, fake_worker: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = CacheLayout(tmp_path / "cache")
    plan = _plan_without_nvcc(monkeypatch)
    builder.ensure_build(plan, layout, notify=lambda m: None)
    for sub in ("tmp", "locks"):  # what a build would write to
        (layout.root / sub).rename(layout.root / f"{sub}.gone")
        (layout.root / sub).write_text("not a folder")
    assert not builder.ensure_build(plan, layout, notify=lambda m: None).compiled


def test_leftovers_of_killed_builds_are_collected(
    tmp_path: Path, fake_worker: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = CacheLayout(tmp_path / "cache")
    plan = _plan_without_nvcc(monkeypatch)
    layout.ensure_writable()
    dead = layout.tmp / f"{plan.key}.999999.abc"
    (dead / "build").mkdir(parents=True)
    young_other = layout.tmp / f"{'0' * 64}.1.young"
    young_other.mkdir()
    old_other = layout.tmp / f"{'1' * 64}.1.old"
    old_other.mkdir()
    past = time.time() - 3 * 24 * 3600
    os.utime(old_other, (past, past))
    builder.ensure_build(plan, layout, notify=lambda m: None)
    assert not dead.exists() and not old_other.exists()
    assert young_other.exists()  # may belong to a build running right now


def test_failed_build_quotes_errors_and_keeps_log(
    tmp_path: Path, fake_worker: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = CacheLayout(tmp_path / "cache")
    plan = _plan_without_nvcc(monkeypatch)
    fake_worker.update(ok=False, log=LOG_GNU)
    with pytest.raises(BuildError) as err:
        builder.ensure_build(plan, layout, notify=lambda m: None)
    exc = err.value
    assert "unsupported GNU version" in exc.message
    assert "Error building extension" not in exc.message
    logs = list(layout.logs.iterdir())
    assert len(logs) == 1 and logs[0].name.startswith(plan.key)
    assert str(logs[0]) in exc.message and "unsupported GNU version" in logs[0].read_text()
    assert "-ccbin" in str(exc.fix)
    assert exc.findings[0].id == "build.compile"
    assert not layout.build_dir(plan.key).exists() and list(layout.tmp.iterdir()) == []


def test_worker_gets_jobs_and_cuda_home(
    tmp_path: Path, fake_worker: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MAX_JOBS", "2")
    plan = _cuda_plan(monkeypatch)
    builder.ensure_build(plan, CacheLayout(tmp_path / "c"), notify=lambda m: None)
    env = fake_worker["env"]
    assert env["MAX_JOBS"] == "2" and env["CUDA_HOME"] == "/opt/cuda"
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"


# ---------------------------------------------------------------------------- locks
_HOLDER = """
import sys, time
from pathlib import Path
from qwen_kvprep.buildcache import CacheLayout
from qwen_kvprep.buildcache.lock import build_lock
with build_lock(CacheLayout(Path(sys.argv[1])), "k" * 64, 5, print):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _hold(cache: Path, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(cache), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_waiter_names_holder_and_gives_up(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path / "cache")
    layout.ensure_writable()
    holder = _hold(layout.root, 30)
    said: list[str] = []
    try:
        start = time.monotonic()
        with pytest.raises(LockTimeout) as err, lock.build_lock(layout, "k" * 64, 0.5, said.append):
            pass
        assert time.monotonic() - start < 5
    finally:
        holder.kill()
        holder.wait()
    assert len(said) == 1
    assert said[0].startswith(f"waiting for build lock held by pid {holder.pid} on ")
    assert "since" in said[0]
    assert f"pid {holder.pid}" in err.value.message
    assert "QWEN_KVPREP_LOCK_TIMEOUT" in str(err.value.fix)


def test_lock_of_a_killed_holder_is_free_at_once(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path / "cache")
    layout.ensure_writable()
    holder = _hold(layout.root, 60)
    holder.kill()  # SIGKILL: no cleanup ran; its owner file is still there
    holder.wait()
    assert layout.owner_path("k" * 64).exists()
    said: list[str] = []
    with lock.build_lock(layout, "k" * 64, 0.5, said.append) as waited:
        assert waited < 0.5
    assert said == []


def test_lock_timeout_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWEN_KVPREP_LOCK_TIMEOUT", "7")
    assert lock.lock_timeout() == 7.0
    assert lock.lock_timeout(3) == 3.0
    monkeypatch.setenv("QWEN_KVPREP_LOCK_TIMEOUT", "soon")
    with pytest.raises(UsageError):
        lock.lock_timeout()


# ---------------------------------------------------------------------------- loader
def _render(tmp_path: Path, cache: Path, key: Any = None) -> Path:
    folder = tmp_path / "pkg"
    folder.mkdir()
    text = render_loader(
        tmp_path / 'ckpt "quoted" ü', [cache], source_hashes(vendored_sources()), key
    )
    (folder / "cpp_kernels.py").write_bytes(text)
    return folder / "cpp_kernels.py"


def test_loader_renders_valid_python_with_marker(tmp_path: Path) -> None:
    path = _render(tmp_path, tmp_path / "cache")
    text = path.read_text(encoding="utf-8")
    assert is_loader(text) and not is_loader("import torch\n")
    compile(text, str(path), "exec")
    assert "{{" not in text


def test_loader_without_build_raises_import_error_naming_fix(tmp_path: Path) -> None:
    """No build, and no qwen-kvprep to build one: an ImportError (the model falls back),
    naming the command, at once."""
    path = _render(tmp_path, tmp_path / "empty-cache")
    code = (
        "import sys, importlib.util, warnings\n"
        "sys.modules['qwen_kvprep'] = None  # as if it were not installed\n"
        "warnings.simplefilter('ignore')\n"
        f"spec = importlib.util.spec_from_file_location('cpp_kernels', {str(path)!r})\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "try:\n    spec.loader.exec_module(m)\n"
        "except ImportError as e:\n    print('IMPORTERROR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "QWEN_KVPREP_CACHE"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert "IMPORTERROR" in out.stdout, out.stderr
    assert "qwen-kvprep fix '" in out.stdout and "not installed" in out.stdout


def test_loader_helpers_agree_with_toolchain(tmp_path: Path) -> None:
    path = _render(tmp_path, tmp_path / "empty-cache")
    namespace: dict[str, Any] = {"__file__": str(path), "__name__": "loader_under_test"}
    source = path.read_text(encoding="utf-8").replace(
        "cache_autogptq_cuda_256 = _resolve()", "pass"
    )
    exec(compile(source, str(path), "exec"), namespace)
    assert namespace["_python_tag"]() == common.python_tag()
    assert namespace["_running"]()["machine"] == common.machine()
    for arch_list, cap in (
        (["8.0"], (8, 6)),
        (["8.6"], (8, 0)),
        (["9.0a"], (10, 0)),
        (["8.0+PTX"], (9, 0)),
        (["9.0a"], (9, 0)),
    ):
        assert namespace["_covers"](arch_list, cap) == archmod.covers(arch_list, cap)


def test_failing_loader_runs_once_per_process(tmp_path: Path) -> None:
    """Each attention layer imports cpp_kernels; a failure must not repeat the search,
    the warning or a build attempt per layer."""
    path = _render(tmp_path, tmp_path / "empty-cache")
    code = (
        "import sys, importlib.util, warnings\n"
        "sys.modules['qwen_kvprep'] = None\n"
        "errors = []\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(3):\n"
        f"        spec = importlib.util.spec_from_file_location('ck', {str(path)!r})\n"
        "        m = importlib.util.module_from_spec(spec)\n"
        "        try:\n            spec.loader.exec_module(m)\n"
        "        except ImportError as e:\n            errors.append(str(e))\n"
        "print(len(errors), len(set(errors)), len(caught))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "QWEN_KVPREP_CACHE"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.stdout.split() == ["3", "1", "1"], out.stdout + out.stderr


def test_a_build_s_files_are_read_as_untrusted(tmp_path: Path) -> None:
    """A shared cache is written by others: the manifest is read bounded and never through a
    FIFO, and the extension it names is a plain file of the build's own folder, by Python
    (doctor, fix, prestart) and by the loader (the model's load) alike."""
    from qwen_kvprep.buildcache.manifest import parse_manifest, read_manifest

    path = _render(tmp_path, tmp_path / "empty-cache")
    namespace: dict[str, Any] = {"__file__": str(path), "__name__": "loader_under_test"}
    source = path.read_text(encoding="utf-8").replace(
        "cache_autogptq_cuda_256 = _resolve()", "pass"
    )
    exec(compile(source, str(path), "exec"), namespace)
    fifo, huge = tmp_path / "fifo", tmp_path / "huge"
    for folder in (fifo, huge):
        folder.mkdir()
    os.mkfifo(fifo / "manifest.json")
    with open(huge / "manifest.json", "wb") as fh:
        fh.truncate(64 << 20)
    for folder in (fifo, huge):
        assert read_manifest(folder) is None  # returns at once: no hang, no 64 MiB read
        with pytest.raises((OSError, ValueError)):
            namespace["_read_manifest"](folder)

    build = tmp_path / "build"
    build.mkdir()
    (build / "ext.so").write_bytes(b"\x7fELF")
    (tmp_path / "evil.so").write_bytes(b"\x7fELF")
    (build / "link.so").symlink_to(tmp_path / "evil.so")
    own = namespace["_own_file"]
    assert own(build, "ext.so") == build / "ext.so"
    for name in ("../evil.so", str(tmp_path / "evil.so"), "link.so", "..", "", None):
        assert own(build, name) is None, name
    inputs = {"sources": {}, "flags": {}, "torch": "2.13.0", "torch_cuda": None,
              "cxx11_abi": True, "python_tag": "cp311", "machine": "linux-x86_64",
              "tool_version": "0", "arch_list": [], "nvcc": None}
    good = {"manifest_version": manifest.MANIFEST_VERSION, "key": "k", "inputs": inputs,
            "cuda": False, "so": "ext.so", "so_sha256": "0" * 64}
    assert parse_manifest(good) is not None
    for name in ("../evil.so", str(tmp_path / "evil.so"), ".."):
        assert parse_manifest({**good, "so": name}) is None, name
    # architectures are parsed by the GPU-coverage checks: an edited entry is refused here
    # (it crashed fix and doctor on a GPU machine), a recorded one is taken
    cuda = {**good, "cuda": True, "covers": ["8.0", "9.0a", "12.0+PTX"],
            "inputs": {**inputs, "arch_list": ["8.0", "9.0a", "12.0+PTX"]}}
    assert parse_manifest(cuda) is not None
    for bad in ("abc", "9", "sm_90", "9.x", "", "9.0+ptx "):
        assert parse_manifest({**cuda, "inputs": {**inputs, "arch_list": [bad]}}) is None, bad
        assert parse_manifest({**cuda, "covers": [bad]}) is None, bad


# -------------------------------------------------------------------- torch's CUDA home
# A machine where torch is a CUDA build, there is no GPU, and `nvcc` on PATH is a link in
# <root>/usr/local/bin (not inside the toolkit): torch.utils.cpp_extension then settles on
# CUDA_HOME=<root>/usr/local at import and logs "No CUDA runtime is found, using
# CUDA_HOME='<root>/usr/local'", while qwen-kvprep builds with the toolkit <root>/cuda.
_AS_CUDA_TORCH = (
    "import runpy, sys, torch\n"
    "torch.cuda._is_compiled = lambda: True\n"
    "torch.version.cuda = '12.4'\n"
    "torch.cuda.is_available = lambda: False\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _cuda_machine(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "include").mkdir()
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 1\n")
    nvcc.chmod(0o755)
    wrapper = tmp_path / "usr" / "local" / "bin"
    wrapper.mkdir(parents=True)
    (wrapper / "nvcc").symlink_to(nvcc)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = f"{wrapper}{os.pathsep}{env.get('PATH', '')}"
    return env, toolkit, tmp_path / "usr" / "local"


def _as_cuda_torch(script: Path, *args: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", _AS_CUDA_TORCH, str(script), *args],
                          capture_output=True, text=True, env=env, timeout=300)
    return done.stdout + done.stderr


def test_the_build_s_torch_facts_leave_torch_s_cuda_home_unresolved(tmp_path: Path) -> None:
    """Planning a build reads torch's extension builder without importing it, so torch
    never announces a CUDA home of its own guessing beside the one the build names."""
    env, _, guessed = _cuda_machine(tmp_path)
    script = tmp_path / "plan.py"
    script.write_text(
        "import sys\n"
        "from qwen_kvprep.probe.toolchain import torch_info\n"
        "print(torch_info().cxx_std)\n"
        "print('imported' if 'torch.utils.cpp_extension' in sys.modules else 'not imported')\n"
    )
    out = _as_cuda_torch(script, env=env)
    assert "not imported" in out and "c++" in out, out
    assert "No CUDA runtime is found" not in out and str(guessed) not in out, out


@pytest.mark.parametrize("cuda", [True, False])
def test_the_build_log_names_no_other_cuda_home_than_the_build_s(
    tmp_path: Path, cuda: bool
) -> None:
    """The build worker gives torch the toolkit the build uses (a CUDA build), and keeps
    torch's guess at one out of a CPU-only build's log."""
    from qwen_kvprep.buildcache import _worker

    env, toolkit, guessed = _cuda_machine(tmp_path)
    check = tmp_path / "check.py"
    check.write_text(
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import _worker\n"
        "m = _worker._import_cpp_extension(sys.argv[2] or None)\n"
        "print('torch CUDA_HOME:', m.CUDA_HOME)\n"
    )
    home = str(toolkit) if cuda else ""
    out = _as_cuda_torch(check, str(Path(_worker.__file__).parent), home, env=env)
    named = {str(toolkit)} if cuda else set()
    assert set(re.findall(r"CUDA_HOME='([^']*)'", out)) <= named, out
    if cuda:
        assert f"torch CUDA_HOME: {toolkit}" in out, out
    # the worker itself, as the builder runs it: its output is the build log
    spec = {"parent": os.getpid(), "name": "nothing", "sources": [str(tmp_path / "none.cpp")],
            "extra_cflags": [], "extra_cuda_cflags": [], "with_cuda": cuda,
            "cuda_home": home or None, "build_directory": str(tmp_path / "build"),
            "require": [], "result": str(tmp_path / "result.json")}
    (tmp_path / "build").mkdir()
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    log = _as_cuda_torch(Path(_worker.__file__), str(tmp_path / "spec.json"), env=env)
    assert "qwen-kvprep: building nothing" in log, log
    assert set(re.findall(r"CUDA_HOME='([^']*)'", log)) <= named, log
    assert str(guessed) + "'" not in log, log
