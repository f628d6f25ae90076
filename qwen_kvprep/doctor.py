"""`doctor`: probe everything, run the checks, never change anything."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from qwen_kvprep.checks import load_all, run_checks
from qwen_kvprep.errors import UsageError
from qwen_kvprep.findings import Finding
from qwen_kvprep.probe import gather
from qwen_kvprep.probe.facts import Facts


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
    if ids is None:
        from qwen_kvprep.steps.prebuilt import doctor_findings

        findings += doctor_findings(directory)
    return facts, findings
