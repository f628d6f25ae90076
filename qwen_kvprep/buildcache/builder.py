"""Plan a build (its ABI inputs and key), find it in the cache, or compile and publish it.

One build per ABI: the key is the sha256 of every input that makes a binary incompatible
(sources, flags, full torch version, torch's CUDA, C++ ABI, Python tag, platform, arch
list, nvcc version, tool version). A build is compiled in `<cache>/tmp/<key>.*` by a
worker process and published with one rename to `<cache>/builds/<key>/`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable, Optional

import filelock

from qwen_kvprep import __version__
from qwen_kvprep.buildcache import arch as archmod
from qwen_kvprep.buildcache.diagnose import advice, first_errors
from qwen_kvprep.buildcache.jobs import compile_jobs
from qwen_kvprep.buildcache.lock import build_lock, lock_timeout
from qwen_kvprep.buildcache.manifest import (
    BUILD_LOG,
    COMPILED,
    EXTENSION_NAME,
    MANIFEST,
    MANIFEST_VERSION,
    BuildInputs,
    Manifest,
    dumps,
    list_builds,
    problem,
    read_manifest,
)
from qwen_kvprep.buildcache.paths import CacheLayout
from qwen_kvprep.common import KERNEL_FILES, machine, python_tag, sha256_bytes, sha256_file
from qwen_kvprep.errors import BuildError, SourceError
from qwen_kvprep.fsutil import fsync_dir
from qwen_kvprep.probe.toolchain import NvccInfo, TorchInfo, nvcc_info, torch_info
from qwen_kvprep.redact import scrub

if TYPE_CHECKING:
    from qwen_kvprep.buildcache._worker import WorkerSpec
    from qwen_kvprep.jsontypes import JSON, JSONObject

CPP, CU = KERNEL_FILES
# What modeling_qwen.py calls; a build without them is refused before it is published.
REQUIRED_FUNCTIONS = (
    "vecquant8matmul_batched_faster_old",
    "vecquant8matmul_batched_column_compression_faster_old",
)
# The official cpp_kernels.py's flags, minus its hard-coded architectures.
CFLAGS = ("-O3",)
CUDA_CFLAGS = ("-O3", "--use_fast_math")
FAILED_LOGS_KEPT = 20
STALE_TMP_SECONDS = 24 * 3600

Notify = Callable[[str], None]


def stderr_notify(message: str) -> None:
    print(f"qwen-kvprep: {scrub(message)}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class BuildPlan:
    key: str
    inputs: BuildInputs
    sources: Mapping[str, bytes]
    cuda: bool
    mode: str  # one plain sentence: what kind of build and why
    torch: TorchInfo
    nvcc: Optional[NvccInfo]
    arch_list: tuple[str, ...] = ()
    arch_origin: Optional[str] = None
    covers: tuple[str, ...] = ()

    @property
    def cuda_cflags(self) -> list[str]:
        return list(self.inputs["flags"]["cuda_cflags"])


@dataclass(frozen=True)
class BuildResult:
    key: str
    dir: Path
    so: Path
    manifest: Manifest
    compiled: bool  # False: found in the cache
    waited: float = 0.0  # seconds spent waiting for another builder's lock
    jobs: Optional[str] = None

    @property
    def cuda(self) -> bool:
        return bool(self.manifest.get("cuda"))

    @property
    def arch_list(self) -> list[str]:
        return list(self.manifest["inputs"].get("arch_list") or [])

    def to_json(self) -> JSONObject:
        arch_list: list[JSON] = list(self.arch_list)
        return {
            "key": self.key,
            "dir": str(self.dir),
            "so": str(self.so),
            "cuda": self.cuda,
            "arch_list": arch_list,
            "compiled": self.compiled,
            "build_seconds": self.manifest.get("build_seconds"),
            "waited_seconds": round(self.waited, 3),
        }


def build_key(inputs: BuildInputs) -> str:
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def plan_build(sources: Mapping[str, bytes], arch: Optional[str] = None) -> BuildPlan:
    """Decide what to build (CUDA or CPU-only, which architectures) and its key."""
    if CPP not in sources:
        raise SourceError(
            f"no {CPP} among the kernel sources", fix="run `qwen-kvprep fix DIR` to choose sources"
        )
    tinfo = torch_info()
    nvcc: Optional[NvccInfo] = None
    arch_list: tuple[str, ...] = ()
    origin: Optional[str] = None
    covers: tuple[str, ...] = ()
    if tinfo.cuda is None:
        mode = f"CPU-only build: torch {tinfo.version} is a CPU build (torch.version.cuda is None)"
    elif CU not in sources:
        mode = f"CPU-only build: the CUDA source {CU} is missing"
    else:
        nvcc, why = nvcc_info()
        if nvcc is None:
            mode = (
                f"CPU-only build: torch {tinfo.version} has CUDA {tinfo.cuda} but there is no "
                f"usable nvcc ({why}); the kernel will refuse GPU tensors"
            )
        else:
            _check_cuda_majors(tinfo, nvcc)
            arch_list, origin = archmod.choose_arch_list(arch, nvcc)
            covers = tuple(a for a in nvcc.arches if archmod.covers(arch_list, _cap(a)))
            mode = (
                f"CUDA build with nvcc {nvcc.version} ({nvcc.cuda_home}) for "
                f"{';'.join(arch_list)} ({origin})"
            )
    cuda = nvcc is not None
    names = sorted(n for n in sources if n in KERNEL_FILES)
    inputs = abi_inputs(
        {n: sha256_bytes(sources[n]) for n in names}, tinfo, arch_list, nvcc
    )
    return BuildPlan(
        key=build_key(inputs),
        inputs=inputs,
        sources={n: sources[n] for n in names},
        cuda=cuda,
        mode=mode,
        torch=tinfo,
        nvcc=nvcc,
        arch_list=arch_list,
        arch_origin=origin,
        covers=covers,
    )


def abi_inputs(
    source_hashes: Mapping[str, str],
    tinfo: TorchInfo,
    arch_list: tuple[str, ...] = (),
    nvcc: Optional[NvccInfo] = None,
) -> BuildInputs:
    """The inputs (and so the key) of a build of these sources with this torch: a CUDA
    build with `nvcc`, else a CPU-only one. A prebuilt CPU variant matches a machine
    exactly when its key equals the key of these inputs (nothing is probed but torch)."""
    cuda = nvcc is not None
    std = f"-std={tinfo.cxx_std}"
    return {
        "sources": dict(sorted(source_hashes.items())),
        "flags": {
            "cflags": [*CFLAGS, std],
            "cuda_cflags": (
                [*CUDA_CFLAGS, std, *archmod.gencode_flags(arch_list)] if cuda else []
            ),
            "with_cuda": cuda,
        },
        "torch": tinfo.version,
        "torch_cuda": tinfo.cuda,
        "cxx11_abi": tinfo.cxx11_abi,
        "python_tag": python_tag(),
        "machine": machine(),
        "arch_list": list(arch_list),
        "nvcc": nvcc.version if nvcc else None,
        "tool_version": __version__,
    }


# What torch.utils.cpp_extension gives nvcc for every .cu (its COMMON_NVCC_FLAGS), for
# torch releases that do not export the list.
_TORCH_NVCC_FLAGS = (
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
)


def nvcc_compile_flags(tinfo: TorchInfo, arch_list: tuple[str, ...] = ()) -> list[str]:
    """The nvcc flags a build of our .cu gets with this torch: torch's own (its common
    nvcc flags, position-independent code, the C++ ABI, the C++ standard its headers need)
    followed by ours. Include paths and -c/-o are the caller's."""
    try:
        import torch.utils.cpp_extension as cpp_extension

        common = list(getattr(cpp_extension, "COMMON_NVCC_FLAGS", _TORCH_NVCC_FLAGS))
    except ImportError:
        common = list(_TORCH_NVCC_FLAGS)
    return [
        *common,
        "-Xcompiler",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(tinfo.cxx11_abi)}",
        *CUDA_CFLAGS,
        f"-std={tinfo.cxx_std}",
        *archmod.gencode_flags(arch_list),
    ]


def _cap(arch: str) -> tuple[int, int]:
    major, minor = arch.split(".")
    return int(major), int(minor.rstrip("af"))


def _check_cuda_majors(tinfo: TorchInfo, nvcc: NvccInfo) -> None:
    # torch.utils.cpp_extension refuses this combination too, after a long traceback.
    if tinfo.cuda_major is not None and nvcc.release[0] != tinfo.cuda_major:
        message = (
            f"nvcc {nvcc.version} ({nvcc.nvcc}) and torch {tinfo.version} (CUDA {tinfo.cuda}) "
            "have different CUDA major versions; an extension built so would not load"
        )
        fix = (
            f"install a CUDA {tinfo.cuda_major}.x toolkit and point CUDA_HOME at it, or install "
            f"a torch wheel built for CUDA {nvcc.release[0]}"
        )
        raise BuildError.failing("build.cuda_mismatch", message, fix)


def find_build(
    layout: CacheLayout, key: str, verify: bool = True, origin: str = COMPILED
) -> Optional[BuildResult]:
    """The published build for `key` if it is complete and intact and of `origin`: a
    library someone else compiled (a prebuilt variant) never stands in for our compile."""
    folder = layout.build_dir(key)
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("key") != key or manifest.get("origin") != origin:
        return None
    if problem(folder, manifest, check_hash=verify) is not None:
        return None
    return BuildResult(key, folder, folder / manifest["so"], manifest, compiled=False)


# What makes a published build loadable in this process; architectures and nvcc only
# decide which GPUs it runs on, which `covers` judges separately.
_RUNTIME_INPUTS = ("sources", "torch", "torch_cuda", "cxx11_abi", "python_tag", "machine",
                   "tool_version")


def not_loadable(
    manifest: Manifest, wanted: BuildInputs, gpus: tuple[tuple[int, int], ...]
) -> Optional[str]:
    """Why a CUDA build cannot serve a process whose build inputs would be `wanted` (the
    first runtime input that differs, or a visible GPU its architectures miss), or None."""
    planned: Mapping[str, object] = wanted
    runtime: Mapping[str, object] = manifest["inputs"]
    for name in _RUNTIME_INPUTS:
        if runtime.get(name) != planned[name]:
            return f"{name} is {runtime.get(name)!r}, this machine has {planned[name]!r}"
    arch_list = manifest["inputs"].get("arch_list") or []
    for cap in gpus:
        if not archmod.covers(arch_list, cap):
            return f"its architectures {';'.join(arch_list)} do not run on GPU {cap[0]}.{cap[1]}"
    return None


def find_compatible(
    layout: CacheLayout, plan: BuildPlan, gpus: tuple[tuple[int, int], ...]
) -> Optional[BuildResult]:
    """A published CUDA build this process can load and that runs on every visible GPU.

    An image built with `build --arch …` and started where nvcc is missing (a runtime
    image) or where the default architecture list differs (the visible GPU) must reuse
    that build rather than fall back to a CPU-only one or compile again.
    """
    for folder, manifest in list_builds(layout.builds):
        if not manifest.get("cuda") or not_loadable(manifest, plan.inputs, gpus) is not None:
            continue
        if problem(folder, manifest) is None:
            key = manifest["key"]
            return BuildResult(key, folder, folder / manifest["so"], manifest, False)
    return None


def ensure_build(
    plan: BuildPlan,
    layout: CacheLayout,
    *,
    force: bool = False,
    timeout: Optional[float] = None,
    notify: Notify = stderr_notify,
) -> BuildResult:
    """Return the build for `plan`, compiling it under the key's lock if needed."""
    wait_limit = lock_timeout(timeout)  # an unreadable limit is refused before any write
    if not force:
        found = find_build(layout, plan.key)
        if found is not None:
            return found
    # Only compiling needs a writable cache: a read-only cache with the build is fine.
    layout.ensure_writable()
    with build_lock(layout, plan.key, wait_limit, notify) as waited:
        if not force or waited > 0:
            # Whoever held the lock has probably just published it (a forced rebuild that
            # had to wait counts the other builder's fresh result as good enough).
            found = find_build(layout, plan.key)
            if found is not None:
                return BuildResult(found.key, found.dir, found.so, found.manifest, False, waited)
        _collect_garbage(layout, plan.key)
        return _compile(plan, layout, waited, notify)


def _compile(plan: BuildPlan, layout: CacheLayout, waited: float, notify: Notify) -> BuildResult:
    jobs, jobs_why = compile_jobs()
    staging = Path(tempfile.mkdtemp(prefix=f"{plan.key}.{os.getpid()}.", dir=layout.tmp))
    try:
        src, build, out = staging / "src", staging / "build", staging / "out"
        for folder in (src, build, out):
            folder.mkdir()
        for name, data in plan.sources.items():
            (src / name).write_bytes(data)
        compiled = [str(src / CPP)] + ([str(src / CU)] if plan.cuda else [])
        log_path = out / BUILD_LOG
        spec: WorkerSpec = {
            "parent": os.getpid(),
            "name": EXTENSION_NAME,
            "sources": compiled,
            "extra_cflags": plan.inputs["flags"]["cflags"],
            "extra_cuda_cflags": plan.inputs["flags"]["cuda_cflags"] + _nvcc_threads(plan, jobs),
            "with_cuda": plan.cuda,
            "cuda_home": str(plan.nvcc.cuda_home) if plan.nvcc is not None else None,
            "build_directory": str(build),
            "require": list(REQUIRED_FUNCTIONS),
            "result": str(staging / "result.json"),
        }
        spec_path = staging / "spec.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        env = dict(os.environ)
        env["MAX_JOBS"] = str(jobs)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        if plan.nvcc is not None:
            # torch guesses CUDA_HOME from `which nvcc`, wrong for wrapper scripts.
            env["CUDA_HOME"] = str(plan.nvcc.cuda_home)
            env["TORCH_CUDA_ARCH_LIST"] = ";".join(plan.arch_list)
        # the staging folder goes away: name where the log stays (in the build, or in logs/)
        kept = layout.build_dir(plan.key) / BUILD_LOG
        notify(
            f"compiling the extension ({plan.mode}; {jobs} job(s): {jobs_why}); log: "
            f"{log_path} while it runs, kept as {kept} (a failed build's in {layout.logs})"
        )
        start = time.monotonic()
        with open(log_path, "wb") as log:
            log.write(
                f"# qwen-kvprep {__version__} build {plan.key}\n# {plan.mode}\n"
                f"# jobs: {jobs} ({jobs_why})\n# inputs: {json.dumps(plan.inputs)}\n".encode()
            )
            log.flush()
            _run_worker(spec_path, log, env, staging)
        seconds = time.monotonic() - start
        result = _read_result(staging / "result.json")
        if not result.get("ok"):
            raise _failure(plan, layout, log_path, result)
        so_src = build / f"{EXTENSION_NAME}.so"
        so = out / so_src.name
        os.replace(so_src, so)
        manifest: Manifest = {
            "manifest_version": MANIFEST_VERSION,
            "key": plan.key,
            "inputs": plan.inputs,
            "cuda": plan.cuda,
            "so": so.name,
            "so_sha256": sha256_file(so),
            "build_seconds": round(seconds, 2),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "covers": list(plan.covers),
            "mode": plan.mode,
            "builder": {"pid": os.getpid(), "host": socket.gethostname(), "jobs": jobs},
            "origin": COMPILED,
        }
        (out / MANIFEST).write_text(dumps(manifest), encoding="utf-8")
        final = _publish(out, layout, plan.key)
        return BuildResult(plan.key, final, final / so.name, manifest, True, waited, jobs_why)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _nvcc_threads(plan: BuildPlan, jobs: int) -> list[str]:
    """nvcc compiles the architectures of one .cu one after another unless told to use
    threads (CUDA >= 11.2). Not part of the key: it does not change the output."""
    if plan.nvcc is None or jobs < 2 or len(plan.arch_list) < 2 or plan.nvcc.release < (11, 2):
        return []
    return ["--threads", str(jobs)]


def _run_worker(spec_path: Path, log: IO[bytes], env: dict[str, str], cwd: Path) -> None:
    worker = Path(__file__).with_name("_worker.py")
    proc = subprocess.Popen(
        [sys.executable, str(worker), str(spec_path)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(cwd),
        start_new_session=True,  # a Ctrl-C in the terminal reaches us, not the compilers
    )
    try:
        proc.wait()
    except BaseException:
        # SIGTERM: the worker kills its whole process tree (see _worker._kill_tree)
        with contextlib.suppress(OSError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise


def _read_result(path: Path) -> JSONObject:
    """What the worker wrote to spec["result"] (its WorkerResult), read as plain JSON: a
    killed worker may have left anything, and every reader has a default."""
    try:
        data: JSON = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"ok": False, "stage": "build", "error": "the build process died without a result"}
    return data if isinstance(data, dict) else {"ok": False}


def _failure(
    plan: BuildPlan, layout: CacheLayout, log_path: Path, result: JSONObject
) -> BuildError:
    stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
    kept = layout.logs / f"{plan.key}-{stamp}-{os.getpid()}.log"
    try:
        shutil.copyfile(log_path, kept)
    except OSError:
        kept = log_path  # lost with the staging folder, but still name it
    _prune_logs(layout)
    text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
    errors = first_errors(text + "\n" + str(result.get("error", "")))
    hints = advice(text + "\n" + str(result.get("error", "")))
    if result.get("stage") == "import":
        what = "the extension compiled but does not load"
    elif result.get("stage") == "check":
        what = "the built extension is incomplete"
    else:
        what = "compiling the extension failed"
    quoted = "\n".join(f"    {line}" for line in errors) or f"    {result.get('error', '?')}"
    message = f"{what} ({plan.mode}):\n{quoted}\n  full log: {kept}"
    fix = "; ".join(hints) if hints else f"read the full log {kept}"
    full = _disk_full(text + "\n" + str(result.get("error", "")), layout)
    if full is not None:
        message, fix = f"{what} ({plan.mode}): {full[0]}\n{quoted}\n  full log: {kept}", full[1]
    return BuildError.failing(
        "build.compile", message, fix, [kept], errors=errors, key=plan.key, log=str(kept)
    )


# The free space a full-disk message asks for: a margin, not a measurement for CUDA. A
# CPU build writes under 1 MiB (measured); a CUDA build writes one cubin per architecture
# and nvcc's intermediate files in TMPDIR while it runs, far more but not measured here.
BUILD_SPACE = 1 << 30


def _disk_full(log: str, layout: CacheLayout) -> Optional[tuple[str, str]]:
    """(what, fix) when the build stopped because a disk is full, else None."""
    if "No space left on device" not in log and "Disk quota exceeded" not in log:
        return None
    places = []
    for folder in dict.fromkeys([str(layout.tmp), tempfile.gettempdir()]):
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            continue
        places.append(f"{folder} ({free / 2**20:,.0f} MiB free)")
    where = " and ".join(places) or str(layout.tmp)
    return (
        f"the disk is full: the compiler could not write its output (No space left on "
        f"device) in {where}",
        f"free at least {BUILD_SPACE >> 30} GiB there (a CPU build writes under 1 MiB; a CUDA "
        "build writes one binary per GPU architecture, and nvcc its temporary files in "
        "TMPDIR: 1 GiB leaves room for both), or build elsewhere with --cache-dir DIR (or "
        "QWEN_KVPREP_CACHE) and TMPDIR on a disk with room; then run the command again",
    )


def _prune_logs(layout: CacheLayout) -> None:
    with contextlib.suppress(OSError):
        logs = sorted(layout.logs.glob("*.log"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in logs[FAILED_LOGS_KEPT:]:
            old.unlink()


def _publish(out: Path, layout: CacheLayout, key: str) -> Path:
    """Rename the finished folder into builds/. A previous build of the key (forced
    rebuild, or a damaged one) is first renamed away into tmp/ and removed."""
    final = layout.build_dir(key)
    if final.exists():
        trash = Path(tempfile.mkdtemp(prefix=f"{key}.old.", dir=layout.tmp))
        os.rename(final, trash / "build")
    os.rename(out, final)
    fsync_dir(layout.builds)
    for old in layout.tmp.glob(f"{key}.old.*"):
        shutil.rmtree(old, ignore_errors=True)
    return final


def _collect_garbage(layout: CacheLayout, key: str) -> None:
    """Remove what killed builds left in tmp/. The caller holds `key`'s lock, so every
    `<key>.*` folder there is dead; other keys' folders go once old and unlocked."""
    now = time.time()
    try:
        entries = list(layout.tmp.iterdir())
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if name.startswith("."):
            continue
        other = name.split(".", 1)[0]
        if other == key:
            shutil.rmtree(entry, ignore_errors=True)
            continue
        try:
            if now - entry.stat().st_mtime < STALE_TMP_SECONDS:
                continue
        except OSError:
            continue
        lock = filelock.FileLock(str(layout.lock_path(other)))
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            continue  # its builder is alive
        try:
            shutil.rmtree(entry, ignore_errors=True)
        finally:
            lock.release()
