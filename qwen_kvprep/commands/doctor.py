from __future__ import annotations

import sys
from typing import Optional

import click

from qwen_kvprep.commands._common import (
    existing_dir,
    exit_code,
    finish,
    json_option,
    strict_option,
)
from qwen_kvprep.render import emit


@click.command()
@click.argument("directory", required=False)
@json_option
@click.option(
    "--check", "check_ids", multiple=True, metavar="ID", help="Run only this check (repeatable)."
)
@click.option("--list-checks", is_flag=True, help="List the check ids and exit.")
@strict_option
@click.option(
    "--report", "as_report", is_flag=True, help="Print a Markdown block for a bug report."
)
def doctor(
    directory: Optional[str], check_ids: tuple[str, ...], list_checks: bool, as_report: bool
) -> None:
    """Find every known reason the Int8 KV cache fails, with a fix for each.

    DIRECTORY is a Qwen checkpoint; without it only the environment and caches are checked.
    doctor never changes anything.
    """
    from qwen_kvprep.checks import load_all
    from qwen_kvprep.doctor import run_doctor
    from qwen_kvprep.render import render_check_list, report_markdown

    if list_checks:
        emit(render_check_list(load_all().values()))
        return
    facts, findings = run_doctor(existing_dir(directory), check_ids, spelt=directory)
    if as_report:
        emit(report_markdown(facts, findings))
        sys.exit(exit_code(findings))
    finish(findings)


def register(group: click.Group) -> None:
    group.add_command(doctor)
