"""`smoke`: prove in a child process that the Int8 KV cache and its kernel really work.

Parent side: runner.py (spawn, timeout, kill), evaluate.py (verdicts and thresholds),
record.py (the result in the checkpoint's state). Child side: child.py. Light imports
only: the CLI imports this package without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from qwen_kvprep.findings import Finding
from qwen_kvprep.smoke.evaluate import evaluate, expected_ratio
from qwen_kvprep.smoke.runner import ChildOutcome, PhaseCallback, SmokeOptions, run_child

__all__ = ["SmokeOptions", "SmokeReport", "expected_ratio", "run_smoke"]


@dataclass(frozen=True)
class SmokeReport:
    findings: list[Finding]
    summary: dict[str, Any]  # the "smoke" object of --json and of state.json
    outcome: ChildOutcome

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
