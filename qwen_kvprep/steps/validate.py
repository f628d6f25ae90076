"""First step of `fix`: refuse a checkpoint that cannot work, before changing anything."""

from __future__ import annotations

from typing import Any

from qwen_kvprep.checks import load_all, run_one
from qwen_kvprep.errors import CheckpointError
from qwen_kvprep.findings import Severity
from qwen_kvprep.probe.facts import Facts


def run(ctx: Any) -> None:
    from qwen_kvprep.probe.checkpoint import probe_checkpoint

    facts = Facts(checkpoint=probe_checkpoint(ctx.directory))
    findings = []
    for chk in load_all().values():
        if chk.area == "checkpoint":
            findings.extend(run_one(chk, facts))
    bad = [f for f in findings if f.severity is Severity.FAIL]
    ctx.add(*[f for f in findings if f.severity is not Severity.OK])
    if bad:
        raise CheckpointError(
            f"{ctx.directory} is not a usable Qwen (v1) checkpoint: {len(bad)} problem(s)",
            fix=bad[0].fix,
            findings=bad,
        )
    ctx.facts = facts
