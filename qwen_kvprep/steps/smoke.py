"""Last step of `fix`: prove the result works (qwen_kvprep.smoke) and record the verdict.

A failing smoke is reported as failing findings (exit 1), not raised: every earlier step
has already done its work, and the findings say what is still wrong.
"""

from __future__ import annotations

import sys
from typing import Optional

from qwen_kvprep.findings import Finding, warn
from qwen_kvprep.jsontypes import as_json_object
from qwen_kvprep.smoke import SmokeOptions, run_smoke
from qwen_kvprep.smoke.progress import PhaseProgress
from qwen_kvprep.smoke.protocol import DEFAULT_TIMEOUT_S
from qwen_kvprep.smoke.record import record_smoke
from qwen_kvprep.smoke.runner import load_path_for
from qwen_kvprep.steps.context import FixContext


def run(ctx: FixContext) -> None:
    opts = ctx.options
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
        SmokeOptions(timeout=timeout, load_path=load_path),
        on_phase=PhaseProgress(sys.stderr) if show else None,
    )
    ctx.add(*report.findings)
    as_json_object(report.summary)  # a TypeError here, not a document json.dumps refuses
    ctx.extra["smoke"] = report.summary
    try:
        record_smoke(ctx.directory, report.summary, ctx.journal)
    except OSError as exc:
        ctx.add(warn("smoke.record", f"could not record the smoke result in the state: {exc}"))


def _spelling_warning(spelt: str, problem: str, ctx: FixContext) -> Finding:
    return warn(
        "smoke.load",
        f"{spelt!r}: {problem}; the smoke loads {ctx.directory} instead",
        f"load the model by {ctx.directory} (with or without a trailing slash)",
        paths=[ctx.directory],
    )
