"""`doctor`: probe everything, run the checks, never change anything."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from qwen_kvprep.checks import load_all, run_checks
from qwen_kvprep.checks.identity import identify
from qwen_kvprep.errors import UsageError
from qwen_kvprep.findings import Finding, Severity
from qwen_kvprep.probe import gather
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.steps.prebuilt import doctor_findings


def validate_check_ids(ids: Sequence[str]) -> list[str]:
    known = load_all()
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise UsageError(
            f"unknown check id(s): {', '.join(unknown)}",
            fix="list them with `qwen-kvprep doctor --list-checks`",
        )
    return list(dict.fromkeys(ids))


def run_doctor(
    directory: Optional[Path], check_ids: Sequence[str] = (), spelt: Optional[str] = None
) -> tuple[Facts, list[Finding]]:
    ids = validate_check_ids(check_ids) if check_ids else None
    facts = gather(directory, spelt)
    findings = run_checks(facts, ids)
    if ids is None and facts.checkpoint is not None and identify(facts.checkpoint).converted:
        return facts, converted_view(findings)
    if ids is None:
        findings += doctor_findings(directory)
    return facts, findings


def converted_view(findings: Sequence[Finding]) -> list[Finding]:
    """What applies to a folder convert wrote: what it is, whether it still matches its
    source, and what an earlier fix left in it (its state and journal, which revert
    undoes). The kernel, build, modules-cache and Qwen (v1) checks (and their skips) say
    nothing about a native Qwen2 checkpoint; `--check ID` still runs any of them."""
    return [
        f for f in findings
        if f.id == "checkpoint.identity"
        or f.area == "convert"
        or (f.area == "state" and f.severity is not Severity.SKIP)
    ]
