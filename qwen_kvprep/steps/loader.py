"""Step of `fix`: replace the checkpoint's cpp_kernels.py (a JIT build at import time,
relative to the working directory) with qwen-kvprep's loader. The journal keeps the
original for `revert`."""

from __future__ import annotations

from qwen_kvprep.buildcache import CacheLayout, resolve_cache_dir, sources_of
from qwen_kvprep.buildcache.loader import render_loader, source_hashes
from qwen_kvprep.common import LOADER_FILE, sha256_bytes
from qwen_kvprep.fastkv import module_bytes
from qwen_kvprep.findings import info, ok
from qwen_kvprep.steps.context import FixContext


def loader_bytes(ctx: FixContext) -> bytes:
    """The rendered loader for this fix (also planted into the modules cache)."""
    root = CacheLayout(resolve_cache_dir(ctx.options.cache_dir)).root
    build = ctx.build
    return render_loader(
        ctx.directory,
        [root],
        source_hashes(sources_of(ctx.sources)),
        build.key if build is not None else ctx.planned_key,
        ctx.prebuilt.variant.manifest["so_sha256"] if ctx.prebuilt is not None else None,
        # the fast path's module as the fastkv step writes it (it runs after this one); a
        # folder whose code it declines never imports the module, so the hash goes unused
        fast_sha256(ctx.options.per_token_prefill) if ctx.options.fast_path else None,
    )


def fast_sha256(per_token_prefill: bool) -> str:
    return sha256_bytes(module_bytes(per_token_prefill))


def run(ctx: FixContext) -> None:
    path = ctx.directory / LOADER_FILE
    changed = ctx.journal.write(LOADER_FILE, loader_bytes(ctx))
    ctx.extra["loader"] = str(path)
    if changed:
        verb = "would install" if ctx.options.dry_run else "installed"
        ctx.add(
            info(
                "build.loader",
                f"{verb} the qwen-kvprep loader as {LOADER_FILE} (the original is kept for revert)",
                paths=[path],
            )
        )
    else:
        ctx.add(ok("build.loader", f"{LOADER_FILE} is already the current loader", paths=[path]))
