"""`smoke`: prove in a child process that the Int8 KV cache and its kernel really work.

Parent side: runner.py (spawn, timeout, kill), evaluate.py (verdicts and thresholds),
record.py (the result in the checkpoint's state). Child side: child.py. Light imports
only: the CLI imports this package without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep.findings import Finding, warn
from qwen_kvprep.smoke.evaluate import SmokeSummary, evaluate, expected_ratio
from qwen_kvprep.smoke.runner import PhaseCallback, SmokeOptions, SmokeOutcome, run_child

__all__ = ["SmokeOptions", "SmokeReport", "expected_ratio", "run_smoke", "smoke_and_record"]


@dataclass(frozen=True)
class SmokeReport:
    findings: list[Finding]
    summary: SmokeSummary  # the "smoke" object of --json and of state.json
    outcome: SmokeOutcome

    @property
    def ok(self) -> bool:
        return bool(self.summary.get("ok"))


def run_smoke(
    directory: Path,
    options: Optional[SmokeOptions] = None,
    on_phase: Optional[PhaseCallback] = None,
) -> SmokeReport:
    """Run the smoke child on `directory` and judge it. Never raises for what the model
    does: crashes, errors and hangs come back as failing findings."""
    options = options or SmokeOptions()
    outcome = run_child(Path(directory), options, on_phase)
    findings, summary = evaluate(outcome, options, str(directory))
    return SmokeReport(findings, summary, outcome)


def smoke_and_record(
    directory: Path,
    options: Optional[SmokeOptions] = None,
    on_phase: Optional[PhaseCallback] = None,
) -> SmokeReport:
    """`qwen-kvprep smoke`: run_smoke, then the verdict recorded in the checkpoint's state
    (when fix left one), under the folder's lock. A state that cannot be written is a
    warning: the smoke itself has been judged."""
    # here: the CLI imports this package for smoke/protocol.py at every start, and the
    # record's journal and build-cache modules would cost it ~15 ms
    from qwen_kvprep.smoke.record import record_smoke

    report = run_smoke(directory, options, on_phase)
    try:
        record_smoke(directory, report.summary)
    except OSError as exc:
        problem = warn("smoke.record", f"could not record the result in the state: {exc}")
        return SmokeReport([*report.findings, problem], report.summary, report.outcome)
    return report
