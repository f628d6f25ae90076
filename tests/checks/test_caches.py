"""The build. and modules. checks on made-up facts, each with its ok and its not-ok
cases, and the cache probes against real files where that is cheap: a real fatbin compiled
with nvcc when there is one, a lock held by a real process."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_kvprep.findings import Severity
from qwen_kvprep.probe.binary import BinaryArchs, CodeEntry, parse_arch_label, read_archs, runs_on
from qwen_kvprep.probe.caches import (
    BuildRecord,
    FolderAccess,
    LockFile,
    folder_access,
    module_folder_candidates,
    open_file_holders,
    probe_caches,
    usable_builds,
)
from qwen_kvprep.probe.env import GpuInfo
from qwen_kvprep.resources import KERNEL_FILES
from tests import needs
from tests.checks.facts import (
    A100,
    H100,
    build,
    caches,
    ckpt,
    env_facts,
    facts,
    folder,
    run,
    text,
    worst,
)

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
    # a folder that serves any modules cache needs no sources there: the copy of its code
    # being current is enough, as with them
    served = ckpt(serves_any_modules_cache=True)
    lacking = caches(modules_root=ro, module_folders=(folder(sources=False),))
    f = facts(checkpoint=served, cache=lacking)
    assert worst("modules.cache", f) is Severity.WARN


def test_modules_folder_ok() -> None:
    assert worst("modules.folder", facts(checkpoint=ckpt(), cache=caches())) is Severity.OK


def test_modules_folder_missing_sources_means_silent_fallback() -> None:
    f = facts(checkpoint=ckpt(), cache=caches(module_folders=(folder(sources=False),)))
    assert worst("modules.folder", f) is Severity.FAIL
    t = text("modules.folder", f)
    assert "KV cache kernel source files (.cpp and .cu) not found." in t
    assert "qwen-kvprep fix /models/Qwen-7B-Chat" in t
    off = ckpt(config={"model_type": "qwen", "use_cache_quantization": False})
    assert (
        worst(
            "modules.folder",
            facts(checkpoint=off, cache=caches(module_folders=(folder(sources=False),))),
        )
        is Severity.INFO
    )


def test_modules_folder_absent_before_first_load_fails_when_the_kernel_is_asked_for() -> None:
    """A fresh container: a server started now creates the folder without the kernel sources
    and falls back, so doctor exits 1; with the cache off that does not matter."""
    absent = caches(module_folders=(folder(exists=False),))
    planted_elsewhere = caches(
        module_folders=(folder(exists=False),),
        state={"modules": {"folder": "/build-time/hf/modules/transformers_modules/Qwen-7B-Chat"}},
    )
    off = ckpt(config={"model_type": "qwen", "use_cache_quantization": False})
    for cache, when_off in ((absent, Severity.INFO), (planted_elsewhere, Severity.WARN)):
        assert worst("modules.folder", facts(checkpoint=ckpt(), cache=cache)) is Severity.FAIL
        assert worst("modules.folder", facts(checkpoint=off, cache=cache)) is when_off
    assert "prestart" in text("modules.folder", facts(checkpoint=ckpt(), cache=planted_elsewhere))


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


def test_module_folder_naming(tmp_path: Path) -> None:
    from qwen_kvprep.common import modules_cache_root

    root, source = modules_cache_root({"HF_HOME": "/hf"})
    assert (root, source) == ("/hf/modules", "HF_HOME")
    assert modules_cache_root({"HF_MODULES_CACHE": "/m", "HF_HOME": "/hf"})[0] == "/m"
    assert modules_cache_root({"XDG_CACHE_HOME": "/x"})[0] == "/x/huggingface/modules"
    snap = Path("/hub/models--Qwen--Qwen-7B-Chat/snapshots/abc123")
    names = [str(p) for p, _ in module_folder_candidates(snap, Path("/m"))]
    assert names == [
        "/m/transformers_modules/abc123",
        "/m/transformers_modules/Qwen/Qwen-7B-Chat/abc123",
        "/m/transformers_modules",  # a load by the path with a trailing slash
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
