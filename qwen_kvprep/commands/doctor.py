from __future__ import annotations

import sys
from typing import Optional

import click

from qwen_kvprep.report import emit


@click.command()
@click.argument("directory", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option(
    "--check", "check_ids", multiple=True, metavar="ID", help="Run only this check (repeatable)."
)
@click.option("--list-checks", is_flag=True, help="List the check ids and exit.")
@click.option("--strict", is_flag=True, help="Warnings fail too (exit 1).")
@click.option(
    "--report", "as_report", is_flag=True, help="Print a Markdown block for a bug report."
)
def doctor(
    directory: Optional[str],
    as_json: bool,
    check_ids: tuple[str, ...],
    list_checks: bool,
    strict: bool,
    as_report: bool,
) -> None:
    """Find every known reason the Int8 KV cache fails, with a fix for each.

    DIRECTORY is a Qwen checkpoint; without it only the environment and caches are checked.
    doctor never changes anything.
    """
    from qwen_kvprep.checks import load_all
    from qwen_kvprep.cli import existing_dir, output_findings
    from qwen_kvprep.doctor import run_doctor

    if list_checks:
        for chk in load_all().values():
            emit(f"{chk.id:<32} {chk.title}")
        return
    facts, findings = run_doctor(existing_dir(directory), check_ids)
    if as_report:
        from qwen_kvprep.redact import report_markdown

        emit(report_markdown(facts, findings))
        sys.exit(1 if any(f.severity.value == "fail" for f in findings) else 0)
    sys.exit(output_findings(findings, as_json, strict))


def register(group: click.Group) -> None:
    group.add_command(doctor)
