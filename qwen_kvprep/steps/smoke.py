"""Last step of `fix`: prove the result works (qwen_kvprep.smoke) and record the verdict.

A failing smoke is reported as failing findings (exit 1), not raised: every earlier step
has already done its work, and the findings say what is still wrong.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

from qwen_kvprep.findings import Finding, ok, warn
from qwen_kvprep.jsontypes import JSONObject, as_json_object
from qwen_kvprep.smoke import SmokeOptions, run_smoke
from qwen_kvprep.smoke.progress import PhaseProgress, log_phases
from qwen_kvprep.smoke.protocol import DEFAULT_TIMEOUT_S
from qwen_kvprep.smoke.record import record_smoke
from qwen_kvprep.smoke.runner import load_path_for
from qwen_kvprep.state.writer import state_path
from qwen_kvprep.steps.context import FixContext


def run(ctx: FixContext) -> None:
    opts = ctx.options
    if ctx.proven is not None and not opts.force_smoke:
        _keep_verdict(ctx, ctx.proven)
        return
    ctx.extra["smoke_from_state"] = False
    timeout = opts.smoke_timeout if opts.smoke_timeout else DEFAULT_TIMEOUT_S
    show = opts.progress if opts.progress is not None else sys.stderr.isatty()
    load_path: Optional[str] = None
    # a view is served from OUT; DIR as spelt only names the read-only original
    if opts.spelling and opts.output is None:
        load_path, problem = load_path_for(opts.spelling)
        if problem is not None:
            ctx.add(_spelling_warning(opts.spelling, problem, ctx))
    report = run_smoke(
        ctx.directory,
        SmokeOptions(timeout=timeout, load_path=load_path,
                     rerun=(opts.rerun, "--smoke-timeout") if opts.rerun else None),
        on_phase=_log_phases(ctx) or (PhaseProgress(sys.stderr) if show else None),
    )
    ctx.add(*report.findings)
    ctx.smoke = report.summary
    ctx.extra["smoke"] = as_json_object(report.summary)
    try:
        record_smoke(ctx.directory, report.summary, ctx.journal)
    except OSError as exc:
        ctx.add(warn("smoke.record", f"could not record the smoke result in the state: {exc}"))


def _keep_verdict(ctx: FixContext, recorded: JSONObject) -> None:
    """Nothing changed since a smoke passed: loading the model again (minutes for a 7B)
    would prove nothing new, and recording it would rewrite the state."""
    when = recorded.get("checked") or "an earlier run"
    ctx.add(
        ok(
            "smoke.recorded",
            f"the smoke passed on {recorded.get('device')} at {when} for exactly these files, "
            "build and packages: not run again (--smoke runs it)",
            paths=[state_path(ctx.directory)],
        )
    )
    ctx.extra["smoke"] = recorded
    ctx.extra["smoke_from_state"] = True
    if ctx.log is not None:
        ctx.log.note("smoke test: passed before for this exact state, not run again")


def _log_phases(ctx: FixContext) -> Optional[Callable[[str], None]]:
    """The child's phases as lines of fix's log."""
    return None if ctx.log is None else log_phases(ctx.log, "smoke: ")


def _spelling_warning(spelt: str, problem: str, ctx: FixContext) -> Finding:
    return warn(
        "smoke.load",
        f"{spelt!r}: {problem}; the smoke loads {ctx.directory} instead",
        f"load the model by {ctx.directory} (with or without a trailing slash)",
        paths=[ctx.directory],
    )
