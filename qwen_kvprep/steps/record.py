"""Step of `fix`: record what was done (hashes, build, planted files) in
`.qwen-kvprep/state.json`, so prestart and doctor can tell in milliseconds, without
importing torch, that nothing changed since."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Optional

from qwen_kvprep.common import KERNEL_FILES
from qwen_kvprep.findings import info, ok
from qwen_kvprep.smoke.record import still_proven
from qwen_kvprep.state.writer import load_state, new_state, same_state, save_state, state_path
from qwen_kvprep.steps.context import FixContext

if TYPE_CHECKING:
    from qwen_kvprep.jsontypes import JSONObject
    from qwen_kvprep.state.reader import State, StateBuild


def _sources(ctx: FixContext) -> JSONObject:
    chosen = ctx.sources
    if ctx.prebuilt is not None:
        return dict(ctx.prebuilt.record)  # what prestart installs again on a fresh cache
    if chosen is None:
        return {"origin": "vendored", "repo_id": None, "revision": None}
    return {"origin": chosen.origin, "repo_id": chosen.repo_id, "revision": chosen.revision}


def _build(ctx: FixContext) -> Optional[StateBuild]:
    build = ctx.build
    if build is None:
        return None
    out: StateBuild = {
        "key": build.key,
        "dir": str(build.dir),
        "so": str(build.so),
        "cuda": build.cuda,
        "arch_list": build.arch_list,
        # a rebuilt library is another library: the smoke verdict must not carry over
        "so_sha256": build.manifest["so_sha256"],
    }
    if ctx.cache_id is not None:
        out["cache_id"] = ctx.cache_id  # the cache by its marker: any path may reach it
    with contextlib.suppress(OSError):
        out["so_size"] = os.stat(build.so).st_size
    return out


def _keep_origin(previous: State, state: State) -> None:
    """A re-run keeps the sources the previous fix installed (origin "checkpoint": "kept
    what the directory had"); those bytes still come from where the state says."""
    same_files = all(previous["files"].get(n) == state["files"].get(n) for n in KERNEL_FILES)
    if (state.get("sources") or {}).get("origin") == "checkpoint" and same_files:
        state["sources"] = previous.get("sources") or state["sources"]


def run(ctx: FixContext) -> None:
    path = state_path(ctx.directory)
    if ctx.options.dry_run:
        ctx.add(info("checkpoint.state", f"would record what fix did in {path}", paths=[path]))
        return
    state = new_state(
        ctx.directory,
        sources=_sources(ctx),
        build=_build(ctx),
        modules=ctx.modules,
    )
    previous = load_state(ctx.directory)
    if previous is not None:
        _keep_origin(previous, state)
    # An unchanged result keeps its smoke verdict; anything else must be proved again.
    if previous is not None and same_state({**previous, "smoke": None}, state):
        state["smoke"] = previous.get("smoke")

        ctx.proven = still_proven(ctx.directory, state["smoke"])
    written = save_state(ctx.journal, state)
    if written:
        ctx.add(info("checkpoint.state", "recorded what fix did", paths=[path]))
    else:
        ctx.add(ok("checkpoint.state", "the recorded state is current", paths=[path]))
    ctx.extra["state"] = str(path)
