"""Step of `fix`: get the extension for the chosen sources from the build cache, compiling
it (under the key's lock) only when no build for this ABI exists yet. `build_into_cache`
is the same for `qwen-kvprep build`, without a checkpoint."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from qwen_kvprep.buildcache import CacheLayout, read_sources, resolve_cache_dir, sources_of
from qwen_kvprep.buildcache import vendored_sources as vendored
from qwen_kvprep.buildcache.arch import visible_gpu_archs
from qwen_kvprep.buildcache.builder import (
    ensure_build,
    find_build,
    find_compatible,
    plan_build,
    stderr_notify,
)
from qwen_kvprep.buildcache.inventory import BuildVanished
from qwen_kvprep.buildcache.loader import is_loader
from qwen_kvprep.buildcache.manifest import BUILD_LOG
from qwen_kvprep.common import KERNEL_FILES, LOADER_FILE
from qwen_kvprep.errors import KvprepError
from qwen_kvprep.findings import Finding, info, ok, skip, warn
from qwen_kvprep.steps import loader
from qwen_kvprep.steps.context import FixContext
from qwen_kvprep.steps.prebuilt import install_for_fix

if TYPE_CHECKING:
    from qwen_kvprep.buildcache.builder import BuildPlan, BuildResult
    from qwen_kvprep.buildcache.paths import CacheLayout
    from qwen_kvprep.jsontypes import JSONObject
    from qwen_kvprep.smoke.progress import StepLog


def _degrade_gracefully(ctx: FixContext) -> list[Finding]:
    """config.json already asks for the kernel; with the original cpp_kernels.py still in
    place the model would JIT-build at import and crash (docs/qwen-v1.md). Our loader instead
    raises ImportError there, and the model falls back with its warning. A loader of ours
    already in place is kept: it may point at a build that works (this run's cache may be
    the only thing wrong)."""
    try:
        current = (ctx.directory / LOADER_FILE).read_bytes()[:4096]
    except OSError:
        current = b""
    if is_loader(current.decode("utf-8", "replace")):
        return []
    try:
        loader.run(ctx)
    except (KvprepError, OSError):
        return []
    return [
        warn(
            "build.loader",
            "installed the loader although the build failed: the model falls back to its "
            "pure-torch path (with a warning) until `qwen-kvprep fix` succeeds",
            paths=[ctx.directory / LOADER_FILE],
        )
    ]


def _reuse_compatible(
    layout: CacheLayout, plan: BuildPlan, arch_option: Optional[str]
) -> Optional[BuildResult]:
    """An existing CUDA build to use instead of the plan, or None.

    Only when the plan is not what the user asked for by name: without nvcc (a runtime
    image whose build stage compiled the extension) the plan is CPU-only, and without
    --arch / TORCH_CUDA_ARCH_LIST it targets the visible GPU; a cached build that covers
    the visible GPUs serves both, and compiling again would only cost time.
    """
    if plan.torch.cuda is None or arch_option or os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return None
    # with nvcc and no GPU the default list is meant to be portable: build it
    if plan.cuda and plan.arch_origin != "the visible GPU(s)":
        return None
    if find_build(layout, plan.key) is not None:
        return None  # the exact build exists: the normal path takes it

    gpus = tuple(
        (int(a.split(".")[0]), int(a.split(".")[1])) for a in visible_gpu_archs()
    )
    return find_compatible(layout, plan, gpus)


def _no_kernel_for_gpus(plan: BuildPlan) -> bool:
    """A CPU-only build where torch has CUDA: GPU users get no kernel (said loudly)."""
    return not plan.cuda and plan.torch.cuda is not None


def log_notify(log: Optional[StepLog], quiet: bool = False) -> Callable[[str], None]:
    """Where the build's notices go: the log (whose heartbeat then says "still compiling"
    while the compiler runs), else stderr as they are; nowhere with -q."""
    if quiet:
        return lambda _message: None
    if log is None:
        return stderr_notify

    def note(message: str) -> None:
        # the heartbeat then says what is being waited for
        what = message.split(" (", 1)[0] if message.startswith(("compiling", "waiting")) else None
        log.note(message, phase=what)

    return note


def run(ctx: FixContext) -> None:
    layout = CacheLayout(resolve_cache_dir(ctx.options.cache_dir))
    ctx.extra["cache_dir"] = str(layout.root)
    if not ctx.options.build:
        ctx.add(
            skip(
                "build.build",
                "not building (--no-build): the loader builds on the first model load where "
                "qwen-kvprep is installed; elsewhere the model falls back to pure torch",
                fix=f"qwen-kvprep build --cache-dir {shlex.quote(str(layout.root))}",
            )
        )
        return
    if ctx.prebuilt is not None:
        install_for_fix(ctx)  # verified before the first write; nothing is compiled
        return
    plan = plan_build(sources_of(ctx.sources), ctx.options.arch)
    mode = warn if _no_kernel_for_gpus(plan) else info
    ctx.add(
        mode(
            "build.mode",
            plan.mode,
            fix=None
            if mode is info
            else "install the CUDA "
            "toolkit matching torch.version.cuda (or set CUDA_HOME) and run fix again",
            arch_list=list(plan.arch_list),
            cuda=plan.cuda,
        )
    )
    short = plan.key[:12]
    reused = _reuse_compatible(layout, plan, ctx.options.arch)
    if reused is not None:
        ctx.use_build(
            reused, ok,
            f"using the cached CUDA build {reused.key[:12]} for {';'.join(reused.arch_list)}: "
            "it loads with this torch and runs on every visible GPU, so nothing is compiled",
        )
        return
    if ctx.options.dry_run:
        found = find_build(layout, plan.key)
        if found is not None:
            ctx.build = found
            ctx.add(
                ok(
                    "build.build",
                    f"build {short} is already in the cache",
                    paths=[found.dir],
                    key=plan.key,
                )
            )
        else:
            ctx.planned_key = plan.key
            ctx.add(
                info(
                    "build.build",
                    f"would build key {plan.key} into {layout.build_dir(plan.key)}",
                    key=plan.key,
                )
            )
        return
    try:
        result = ensure_build(plan, layout, notify=log_notify(ctx.log, ctx.options.quiet))
        if not result.compiled:
            try:
                ctx.use_build(result, ok, f"using the cached build {short}{_waited(result)}")
                return
            except BuildVanished:
                # pruned between the look-up and the record: now the record keeps it
                result = ensure_build(plan, layout, notify=log_notify(ctx.log, ctx.options.quiet))
    except KvprepError as exc:
        # the CLI prints the error's findings (ctx's are lost with the exception)
        exc.findings = (*exc.findings, *_degrade_gracefully(ctx))
        raise
    if result.compiled:
        ctx.use_build(
            result, info,
            f"compiled build {short} in {result.manifest['build_seconds']:.0f} s "
            f"({result.jobs}); log: {result.dir / BUILD_LOG}",
        )
    else:
        ctx.use_build(result, ok, f"using the cached build {short}{_waited(result)}")


def _waited(result: BuildResult) -> str:
    return f" after waiting {result.waited:.0f} s for another builder" if result.waited else ""


@dataclass(frozen=True)
class CacheBuild:
    """What `qwen-kvprep build` did: its findings and the build it found or compiled."""

    findings: list[Finding]
    result: BuildResult
    cache_dir: Path

    def to_json(self) -> JSONObject:
        return {"build": self.result.to_json(), "cache_dir": str(self.cache_dir),
                "key": self.result.key}


def build_into_cache(
    source_dir: Optional[Path] = None,
    arch: Optional[str] = None,
    cache_dir: Optional[Path] = None,
    force: bool = False,
    lock_timeout: Optional[float] = None,
    log: Optional[StepLog] = None,
    quiet: bool = False,
) -> CacheBuild:
    """The extension for this torch in the build cache, compiled (under the key's lock) only
    when the cache has no build of these sources for this ABI, or with `force`. No
    checkpoint is involved: the sources are qwen-kvprep's own, or those in `source_dir`.
    `log`: a line a notice and a heartbeat while compiling (a log that is not a terminal);
    `quiet`: no notice at all."""
    layout = CacheLayout(resolve_cache_dir(cache_dir))
    sources = read_sources(source_dir, required=KERNEL_FILES[:1]) if source_dir else vendored()
    plan = plan_build(sources, arch)
    findings = [(warn if _no_kernel_for_gpus(plan) else info)("build.mode", plan.mode)]
    if log is not None:
        log.phase("looking up the extension in the build cache")
    result = ensure_build(plan, layout, force=force, timeout=lock_timeout,
                          notify=log_notify(log, quiet))
    if result.compiled:
        message = f"compiled in {result.manifest['build_seconds']:.0f} s ({result.jobs})"
        findings.append(info("build.build", message, paths=[result.dir], details=result.to_json()))
    else:
        findings.append(
            ok("build.build", "found in the cache", paths=[result.dir], details=result.to_json())
        )
    return CacheBuild(findings, result, layout.root)
