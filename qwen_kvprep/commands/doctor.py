from __future__ import annotations

import sys
from typing import Optional

import click

from qwen_kvprep.checks import load_all
from qwen_kvprep.commands._common import (
    REVISION_HELP,
    checkpoint_dir,
    exit_code,
    finish,
    json_option,
    output_options,
    strict_option,
)
from qwen_kvprep.errors import UsageError
from qwen_kvprep.render import emit, render_check_list, render_json, report_markdown


@click.command()
@click.argument("directory", required=False)
@json_option
@click.option(
    "--check", "check_ids", multiple=True, metavar="ID", help="Run only this check (repeatable)."
)
@click.option("--list-checks", is_flag=True, help="List the check ids and exit.")
@strict_option
@click.option("--revision", metavar="REV", help=REVISION_HELP)
@click.option(
    "--report", "as_report", is_flag=True, help="Print a Markdown block for a bug report."
)
def doctor(
    directory: Optional[str],
    check_ids: tuple[str, ...],
    list_checks: bool,
    revision: Optional[str],
    as_report: bool,
) -> None:
    """Find every known reason the Int8 KV cache fails, with a fix for each.

    DIRECTORY is a Qwen checkpoint folder, or a Hub repo id (ORG/NAME) found in the local
    Hub cache; without it only the environment and caches are checked. doctor never
    changes anything. Exit 1: a server started now would not run the Int8 cache through
    the kernel although the config asks for it, or would not load the model.
    """
    # here, not at the top: the checks and probes cost every start of the CLI, --help
    # included, ~40 ms
    from qwen_kvprep.doctor import run_doctor

    as_json = output_options().as_json
    if list_checks:
        checks = load_all().values()
        emit(render_json([], checks=[{"id": c.id, "title": c.title} for c in checks])
             if as_json else render_check_list(checks))
        return
    path, spelt = checkpoint_dir(directory, revision) if directory is not None else (None, None)
    if directory is None and revision is not None:
        raise UsageError("--revision picks a snapshot of a Hub repo: give the repo id too")
    facts, findings = run_doctor(path, check_ids, spelt=spelt)
    if as_report and not as_json:
        emit(report_markdown(facts, findings))
        sys.exit(exit_code(findings))
    if as_report:  # --json: the findings document, the Markdown block under `report`
        finish(findings, report=report_markdown(facts, findings))
    finish(findings)


def register(group: click.Group) -> None:
    group.add_command(doctor)
