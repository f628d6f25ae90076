"""Cache checks: the build cache and the GPU code its builds carry (`build.`), and
transformers' modules cache, where the model code really runs from (`modules.`)."""

from __future__ import annotations

import os
import shlex
from typing import Optional

from qwen_kvprep.buildcache.arch import covers
from qwen_kvprep.checks.kernels import kernel_requested
from qwen_kvprep.checks.registry import (
    CACHES,
    GIVEN_CHECKPOINT,
    QWEN_V1,
    TORCH,
    caches_of,
    check,
    checkpoint_of,
    env_of,
)
from qwen_kvprep.checks.verdicts import fail, info, ok, skip, warn
from qwen_kvprep.common import FAST_FILE, KERNEL_FILES, prestart_command
from qwen_kvprep.common import LOADER_FILE as LOADER
from qwen_kvprep.findings import Finding, FindingsLike
from qwen_kvprep.probe.binary import BinaryArchs, runs_on
from qwen_kvprep.probe.caches import (
    HUB,
    LOCAL,
    BuildRecord,
    CacheFacts,
    LockFile,
    ModuleFolder,
    serving_builds,
    usable_builds,
)
from qwen_kvprep.probe.env import GpuInfo
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.probe.planned import PlannedFile

FALLBACK_WARNING = "KV cache kernel source files (.cpp and .cu) not found."
CACHE_FIX = "use another folder: `--cache-dir DIR` or `export QWEN_KVPREP_CACHE=DIR`"


def _fix_cmd(facts: Facts) -> str:
    cp = facts.checkpoint
    return cp.fix_command if cp is not None else "qwen-kvprep fix DIR"


@check("build.cache", "Build cache folder writable", needs=(CACHES,))
def build_cache(facts: Facts) -> FindingsLike:
    caches = caches_of(facts)
    acc = caches.build_cache
    if acc is None:
        return skip("the build cache folder could not be determined")
    usable = usable_builds(caches, facts.env)
    details = {
        "path": acc.path,
        "source": acc.source,
        "exists": acc.exists,
        "builds": len(caches.builds),
        "usable_builds": [b.key for b in usable],
    }
    if acc.writable:
        state = "" if acc.exists else " (created by the first build)"
        return ok(
            f"build cache {acc.path}{state} is writable; {len(caches.builds)} build(s), "
            f"{len(usable)} for this torch",
            paths=[acc.path],
            details=details,
        )
    message = (
        f"the build cache folder {acc.path} (from {acc.source}) cannot be written: {acc.reason}"
    )
    if usable:
        return warn(
            f"{message}; the existing build for this torch can be used, "
            "but nothing new can be built",
            CACHE_FIX,
            paths=[acc.path],
            details=details,
        )
    return fail(
        f"{message}, so the extension can be neither built nor published",
        CACHE_FIX,
        paths=[acc.path],
        details=details,
    )


def _describe(archs: Optional[BinaryArchs]) -> str:
    if archs is None:
        return "no GPU code (a CPU-only build)"
    return ", ".join(archs.labels()) or "no GPU code"


def _claims(b: BuildRecord, capability: tuple[int, int]) -> bool:
    """Whether the build's manifest says it covers this GPU: the loader picks by this."""
    arch_list = b.input("arch_list")
    if not b.cuda or not isinstance(arch_list, list):
        return False
    try:
        return covers([str(a) for a in arch_list], capability)
    except ValueError:  # a malformed entry covers nothing
        return False


def _binary_on_gpu(b: BuildRecord, gpu: GpuInfo, label: str, rebuild: str) -> Finding:
    cc = f"{gpu.capability[0]}.{gpu.capability[1]}"
    fix = rebuild.replace("ARCH", cc)
    return _code_on_gpu(
        b.archs,
        b.so_path,
        b.dir,
        gpu,
        label,
        claim=f" claims {cc} in its manifest but its binary",
        fixes=(fix, fix + " (and `--force`)"),
        ptx_note=True,
    )


def _jit_on_gpu(archs: BinaryArchs, gpu: GpuInfo, fix: str) -> Finding:
    # Built by Qwen's original cpp_kernels.py in the modules cache: its arch flags come
    # from the nvcc version, not from the GPU.
    label = "the extension Qwen's original cpp_kernels.py built"
    return _code_on_gpu(
        archs,
        archs.path,
        archs.path,
        gpu,
        label,
        claim=f" ({archs.path})",
        fixes=(fix, fix),
        ptx_note=False,
    )


def _code_on_gpu(
    archs: Optional[BinaryArchs],
    binary: Optional[str],
    where: str,
    gpu: GpuInfo,
    label: str,
    *,
    claim: str,
    fixes: tuple[str, str],
    ptx_note: bool,
) -> Finding:
    """build.arch of one extension on one GPU: its binary cannot be read (warn), carries
    nothing that runs there (fail), runs there through PTX alone (info where `ptx_note`:
    qwen-kvprep's own builds, which `build --arch` can give SASS) or carries code for it.
    `claim` follows the label when nothing runs there; `fixes` are the fix for an
    unreadable binary and the fix for missing code; `where` is the path the findings name."""
    d: dict[str, object] = {
        "binary": binary,
        "code": archs.labels() if archs else [],
        "gpu": gpu.label,
    }
    if archs is None or archs.error:
        why = archs.error if archs else "not read"
        return warn(
            f"{label}: cannot read {binary}: {why}",
            fixes[0],
            paths=[where],
            details=d,
        )
    entry = runs_on(archs.entries, gpu.capability)
    if entry is None:
        return fail(
            f"{label}{claim} carries {_describe(archs)}, nothing that runs on GPU {gpu.index} "
            f"{gpu.label}: the first kernel call fails with `CUDA error: no kernel image is "
            "available for execution on the device`",
            fixes[1],
            paths=[where],
            details=d,
        )
    if ptx_note and entry.kind == "ptx":
        return info(
            f"{label} runs on GPU {gpu.index} {gpu.label} through PTX {entry.label} "
            "(JIT-compiled at first use; SASS for it would start faster)",
            paths=[where],
            details=d,
        )
    return ok(
        f"{label} carries {entry.label} for GPU {gpu.index} {gpu.label}",
        paths=[where],
        details=d,
    )


@check("build.arch", "The built extension carries code for each visible GPU", needs=(CACHES, TORCH))
def build_arch(facts: Facts) -> FindingsLike:
    caches = caches_of(facts)
    env = env_of(facts)
    rebuild = 'qwen-kvprep build --arch "ARCH", then ' + _fix_cmd(facts)
    builds = serving_builds(caches, env, getattr(facts.checkpoint, "kernel_sources", None))
    jit = [a for mf in caches.module_folders for a in mf.jit_builds]
    if not env.gpus:
        parts = [f"build {b.key[:12]}: {_describe(b.archs)}" for b in builds]
        parts += [f"{a.path}: {_describe(a)}" for a in jit]
        if not parts:
            return skip("no GPU visible and no build for this torch yet")
        return info("no GPU visible to check against; " + "; ".join(parts))
    if not env.torch_is_cuda:
        return skip("torch is a CPU build: the kernel runs on the CPU (see env.gpu)")
    out: list[Finding] = []
    for g in env.gpus:
        cc = f"{g.capability[0]}.{g.capability[1]}"
        # The loader takes the first build (fix's own first) whose manifest covers the GPU;
        # the binary must then really carry code for it.
        chosen = next((b for b in builds if _claims(b, g.capability)), None)
        if chosen is not None:
            out.append(_binary_on_gpu(chosen, g, f"the build {chosen.key[:12]}", rebuild))
        elif builds:
            listing = "; ".join(f"{b.key[:12]}: {_describe(b.archs)}" for b in builds)
            out.append(
                fail(
                    f"no build for this torch carries code for GPU {g.index} {g.label} "
                    f"({listing}): code for other architectures fails there with `no kernel "
                    "image is available for execution on the device`, so the loader skips "
                    "them and compiles at the first load, or falls back to the slow path "
                    "where qwen-kvprep is not installed",
                    rebuild.replace("ARCH", cc),
                    paths=[b.dir for b in builds],
                    gpu=g.label,
                    builds={b.key: _describe(b.archs) for b in builds},
                )
            )
        elif not jit:
            out.append(
                info(
                    f"no build for this torch yet: `{_fix_cmd(facts)}` builds one for "
                    f"GPU {g.index} {g.label}",
                    gpu=g.label,
                )
            )
        out += [_jit_on_gpu(a, g, _fix_cmd(facts)) for a in jit]
    return out


# ---------------------------------------------------------------------------------------


@check("modules.cache", "transformers' modules cache writable", needs=(CACHES,))
def modules_cache(facts: Facts) -> FindingsLike:
    caches = caches_of(facts)
    acc = caches.modules_root
    if acc is None:
        return skip("the modules cache folder could not be determined")
    details = {"path": acc.path, "source": acc.source, "exists": acc.exists}
    if acc.writable:
        return ok(
            f"modules cache {acc.path} (from {acc.source}) is writable",
            paths=[acc.path],
            details=details,
        )
    message = (
        f"transformers' modules cache {acc.path} (from {acc.source}) cannot be written: "
        f"{acc.reason}; from_pretrained copies the remote code there at every load"
    )
    fix = "export HF_MODULES_CACHE=DIR (a writable folder), then " + _fix_cmd(facts) + " again"
    mf = caches.module_folder
    # a folder that serves any modules cache needs only the copy of its code there
    needed = (LOADER,) if getattr(facts.checkpoint, "serves_any_modules_cache", False) else (
        *KERNEL_FILES,
        LOADER,
    )
    complete = mf is not None and mf.exists and all(mf.files.get(n) for n in needed)
    if complete:
        return warn(
            message + ", which works only while the copy there is already current",
            fix,
            paths=[acc.path],
            details=details,
        )
    return fail(
        message + ", so loading the model fails",
        fix,
        paths=[acc.path],
        details=details,
    )


def _state_folder(caches: CacheFacts) -> Optional[str]:
    modules = caches.state.get("modules") if caches.state else None
    folder = modules.get("folder") if isinstance(modules, dict) else None
    return str(folder) if folder else None


def _judge_folder(facts: Facts, mf: ModuleFolder, requested: bool) -> Finding:
    cp = facts.checkpoint
    fix = _fix_cmd(facts)
    details: dict[str, object] = {
        "folder": mf.path,
        "how": mf.how,
        "files": dict(mf.files),
        "loader_is_ours": mf.loader_is_ours,
    }
    # a folder only another spelling of DIR leads to (DIR/, a symlink's real path): say so
    where = mf.path if mf.how in (LOCAL, HUB) else (
        f"{mf.path} (the folder a load by {mf.how} runs the model code from)"
    )
    missing = [n for n in KERNEL_FILES if not mf.files.get(n)]
    if missing and getattr(cp, "serves_any_modules_cache", False):
        return ok(
            f"{where} lacks {' and '.join(missing)}, which no load needs there: the "
            "checkpoint's compatibility module gives every attention layer the extension "
            "from the loader without them, and the fast path from the checkpoint",
            paths=[mf.path],
            details=details,
        )
    if missing:
        message = (
            f"{where} lacks {' and '.join(missing)}: the model looks for the kernel sources "
            f"beside this copy of its code, warns `{FALLBACK_WARNING}` and silently runs the "
            "slow pure-torch path"
        )
        if getattr(cp, "loader_is_ours", False) and (
            os.path.abspath(mf.path) not in _planted_folders(facts)
        ):
            # a fix the modules cache of this environment never saw: not a fix cut short
            fix = _prepare_cmd(facts)
            message += (
                " (a modules cache this folder's fix never prepared: a fresh HF_HOME or "
                "HF_MODULES_CACHE; the folder was fixed by an earlier qwen-kvprep, whose "
                "files do not serve such a cache by themselves)"
            )
        if requested:
            return fail(message, fix, paths=[mf.path], details=details)
        return info(
            message + " (the config does not ask for the kernel yet)",
            fix,
            paths=[mf.path],
            details=details,
        )
    ckpt_sources = getattr(cp, "kernel_sources", None) or {}
    stale = [
        n for n in KERNEL_FILES if ckpt_sources.get(n) and ckpt_sources.get(n) != mf.files.get(n)
    ]
    if stale:
        return warn(
            f"the kernel sources in {where} differ from the checkpoint's ({', '.join(stale)}), "
            "so the model builds or loads different kernels than the checkpoint holds",
            fix,
            paths=[mf.path],
            details=details,
        )
    if mf.loader_is_ours is False:
        if getattr(cp, "loader_is_ours", False):
            return info(
                f"{where} still holds Qwen's original {LOADER}; transformers replaces it "
                "with the checkpoint's (qwen-kvprep's loader) at the next load",
                paths=[mf.path],
                details=details,
            )
        message = (
            f"{where} holds Qwen's original {LOADER}, which compiles the sources at import "
            "with paths relative to the working directory: started anywhere else, "
            "from_pretrained fails with `FileNotFoundError: './cache_autogptq_cuda_256.cpp'`"
        )
        if requested:
            return fail(message, fix, paths=[mf.path], details=details)
        return info(message, fix, paths=[mf.path], details=details)
    if mf.loader_is_ours is None:
        return info(
            f"{where} holds the kernel sources; transformers copies the loader {LOADER} "
            "in at the next load",
            paths=[mf.path],
            details=details,
        )
    return ok(
        f"{where} holds the kernel sources and qwen-kvprep's loader",
        paths=[mf.path],
        details=details,
    )


@check(
    "modules.folder",
    "The checkpoint's modules-cache folder holds the kernel sources and loader",
    needs=(CACHES, GIVEN_CHECKPOINT, QWEN_V1),
)
def modules_folder(facts: Facts) -> FindingsLike:
    caches = caches_of(facts)
    cp = checkpoint_of(facts)
    if not caches.module_folders:
        return skip("the modules-cache folder could not be determined")
    requested = kernel_requested(facts)
    existing = [mf for mf in caches.module_folders if mf.exists]
    planted = _state_folder(caches)
    primary = caches.module_folders[0]
    if not existing:
        # A server started now creates the folder without the kernel sources and falls
        # back: when the config asks for the kernel, that is the failure doctor exits 1 for.
        details = {"folder": primary.path, "state_folder": planted}
        if getattr(cp, "loader_is_ours", False) and getattr(cp, "serves_any_modules_cache", False):
            return ok(
                f"{primary.path} does not exist yet: transformers creates it at the first load "
                "with the model's code alone, and the checkpoint's compatibility module gives "
                "that load the kernel and the fast path from the checkpoint",
                paths=[primary.path],
                details=details,
            )
        if planted and planted != primary.path:
            return (fail if requested else warn)(
                f"`fix` planted the kernel sources in {planted}, but this environment's "
                f"modules cache points at {primary.path} (HF_HOME/HF_MODULES_CACHE differ): the "
                f"first load creates it without them, warns `{FALLBACK_WARNING}` and silently "
                "falls back to the slow path",
                _prepare_cmd(facts),
                paths=[primary.path],
                details=details,
            )
        return (fail if requested else info)(
            f"{primary.path} does not exist yet: transformers creates it at the first load and "
            "copies only .py files, so unless `qwen-kvprep fix` or `prestart` plants the kernel "
            "sources there the model silently falls back to the slow path",
            _fix_cmd(facts),
            paths=[primary.path],
            details=details,
        )
    return [_judge_folder(facts, mf, requested) for mf in existing]


def _prepare_cmd(facts: Facts) -> str:
    """The advice for a modules cache a correct fix never prepared (never revert: the
    folder's own files are right)."""
    cp = checkpoint_of(facts)
    return (
        f"run `{prestart_command(cp.path)}` (CMD: your server command) or "
        f"`{_fix_cmd(facts)}` with this environment; `{_fix_cmd(facts)}` also makes the "
        "folder serve any modules cache by itself"
    )


def _planted_folders(facts: Facts) -> set[str]:
    """The modules-cache folders fix's journal or state says it planted files in."""
    caches = caches_of(facts)
    out = {os.path.abspath(p.folder) for p in caches.planned_files if p.folder is not None}
    modules = caches.state.get("modules") if caches.state else None
    if isinstance(modules, dict):
        for key in ("folder", "hub_folder"):
            if isinstance(modules.get(key), str):
                out.add(os.path.abspath(str(modules[key])))
        also = modules.get("also")
        if isinstance(also, list):
            out |= {os.path.abspath(a) for a in also if isinstance(a, str)}
    return out


# What a load does when a modules-cache folder lacks one of fix's files.
_WITHOUT = {
    FAST_FILE: "every load warns `qwen-kvprep's fast path is not loaded` and runs the "
    "model's own, slower code",
    **{
        n: f"the model warns `{FALLBACK_WARNING}` and silently runs the slow path"
        for n in KERNEL_FILES
    },
}


def _unfinished(caches: CacheFacts) -> dict[str, PlannedFile]:
    """The files the journal says fix wrote, in the checkpoint and in the existing
    modules-cache folders its code runs from, that are not there as it wrote them (files
    planted in other folders, such as those of the code before an upgrade, serve no load)."""
    existing = {os.path.abspath(mf.path) for mf in caches.module_folders if mf.exists}
    refreshed = {os.path.abspath(mf.path) for mf in caches.module_folders if mf.how != HUB}
    out: dict[str, PlannedFile] = {}
    for p in caches.planned_files:
        if p.found == p.planned or (p.folder is not None and p.folder not in existing):
            continue
        if p.folder is None and p.found is not None and not p.earlier:
            continue  # changed since fix wrote it: the user's file (state.journal says so)
        if p.folder in refreshed and p.name == LOADER:
            # transformers copies the checkpoint's cpp_kernels.py, which the model code
            # imports, into a folder loaded by path at every load: the checkpoint's counts
            continue
        out[p.path] = p
    return out


def _state_of(p: PlannedFile) -> str:
    if p.found is None:
        return "is missing" if p.what == "nothing" else f"is {p.what}"
    if p.earlier:
        return "still holds what was there before fix wrote it"
    return "holds another version than fix wrote"


@check(
    "modules.complete",
    "Everything fix planned for the checkpoint and its modules-cache folders is in place",
    needs=(CACHES, GIVEN_CHECKPOINT, QWEN_V1),
)
def modules_complete(facts: Facts) -> FindingsLike:
    caches = caches_of(facts)
    cp = checkpoint_of(facts)
    if caches.revert_undone:
        return skip("a revert was cut short, not a fix (see state.record)")
    unfinished = _unfinished(caches)
    problems = {path: _state_of(p) for path, p in unfinished.items()}
    effects = {_WITHOUT[p.name] for p in unfinished.values() if p.folder and p.name in _WITHOUT}
    # The fast path's module is imported from the modules-cache folder by a hidden import,
    # so transformers never copies it there: fix and prestart plant it, and a fix cut short
    # before its journal named the file leaves no other trace of it.
    # A folder without the module that neither the journal nor the state names is a
    # modules cache this fix never prepared (a fresh HF_HOME), not one it left half done:
    # modules.folder judges it, and never advises revert.
    planted = _planted_folders(facts)
    if cp.fast_path_imported and cp.fast_module_sha256:
        for mf in caches.module_folders:
            path = os.path.join(mf.path, FAST_FILE)
            have = mf.files.get(FAST_FILE)
            if have is None and os.path.abspath(mf.path) not in planted:
                continue
            if mf.exists and have != cp.fast_module_sha256 and path not in problems:
                problems[path] = (
                    "is missing" if have is None else "is not the checkpoint's version"
                )
                effects.add(_WITHOUT[FAST_FILE])
    if not problems and not caches.planned_files:
        return ok("nothing fix planned is left undone (it has journaled no write here)")
    if not problems:
        return ok(
            f"nothing fix planned is left undone ({len(caches.planned_files)} file(s) it wrote "
            "in the checkpoint and the modules cache checked against its journal)"
        )
    listing = "; ".join(f"{path} {state}" for path, state in problems.items())
    effect = f"; so {'; '.join(sorted(effects))}" if effects else ""
    revert = f"qwen-kvprep revert {shlex.quote(str(cp.path))}"
    return fail(
        f"fix did not finish what it planned, as a fix cut short (Ctrl-C, a kill, a full "
        f"disk) leaves it: {listing}{effect}",
        f"`{_fix_cmd(facts)}` finishes it (or `{revert}` undoes it)",
        paths=list(problems),
        details={"unfinished": problems},
    )


def _age(lock: LockFile) -> str:
    if lock.age_s is None:
        return ""
    a = lock.age_s
    text = f"{a:.0f} s" if a < 120 else f"{a / 60:.0f} min" if a < 7200 else f"{a / 3600:.1f} h"
    return f", {text} old"


@check(
    "modules.stale_lock",
    "Leftover torch JIT lock files (a load that waits forever)",
    needs=(CACHES,),
)
def stale_lock(facts: Facts) -> FindingsLike:
    caches = caches_of(facts)
    root = caches.modules_root.path if caches.modules_root else "the modules cache"
    if not caches.locks_scanned:
        return skip("the modules cache was not scanned")
    if not caches.locks:
        return ok(f"no torch JIT lock files under {root}")
    out: list[Finding] = []
    for lock in caches.locks:
        details: dict[str, object] = {
            "lock": lock.path,
            "age_s": lock.age_s,
            "holders": [list(h) for h in lock.holders],
        }
        clear = f"rm -f {shlex.quote(lock.path)}"
        if lock.holders:
            who = "; ".join(f"PID {pid} ({cmd})" for pid, cmd in lock.holders)
            out.append(
                info(
                    f"{lock.path} is held by a running build: {who}",
                    paths=[lock.path],
                    details=details,
                )
            )
        elif lock.unreadable:
            out.append(
                warn(
                    f"{lock.path}{_age(lock)} is probably left over from a killed build (the open "
                    f"files of {lock.unreadable} other processes could not be inspected): if so, "
                    "every later load of the model waits on it forever",
                    f"if no build is running: {clear}",
                    paths=[lock.path],
                    details=details,
                )
            )
        else:
            out.append(
                fail(
                    f"{lock.path}{_age(lock)} is left over from a killed build (no process holds "
                    "it): every later load of the model waits on it forever",
                    clear,
                    paths=[lock.path],
                    details=details,
                )
            )
    return out
