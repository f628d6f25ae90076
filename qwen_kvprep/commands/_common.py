"""What the commands share: the output options click's context carries, the directory
arguments, and the end of a command that prints findings."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn, Optional, TypeVar

import click
from click.core import ParameterSource

from qwen_kvprep.errors import EXIT_FAILED, EXIT_OK, UsageError
from qwen_kvprep.findings import Finding, failed
from qwen_kvprep.hubcache import resolve
from qwen_kvprep.render import emit, print_findings, render_quiet

F = TypeVar("F", bound=Callable[..., object])


@dataclass
class OutputOptions:
    """--json, --debug and --strict, wherever on the command line they are.

    Set by the options' callbacks, which click runs before those of every other parameter
    (the options are eager): an error raised while the rest is parsed or run is already
    reported in the chosen form. `cli.main` hands one in and reads it when it reports an
    error; the commands read it through `output_options()`."""

    as_json: bool = False
    debug: bool = False
    strict: bool = False


def output_options() -> OutputOptions:
    return click.get_current_context().ensure_object(OutputOptions)


def _flag(name: str, option: str, help: str) -> Callable[[F], F]:
    def remember(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
        if value:
            setattr(ctx.ensure_object(OutputOptions), name, True)
        return value

    return click.option(
        option, is_flag=True, is_eager=True, expose_value=False, callback=remember, help=help
    )


json_option = _flag("as_json", "--json", "Print one JSON document.")
strict_option = _flag("strict", "--strict", "Warnings fail too (exit 1).")
debug_option = _flag("debug", "--debug", "Show Python tracebacks for failures.")


def checkpoint_dir(
    value: str, revision: Optional[str] = None, revision_of_folder: bool = False,
    quiet: bool = False,
) -> tuple[Path, str]:
    """(the checkpoint folder, its spelling for checkpoint.dirname) that DIRECTORY names: a
    folder, a Hub cache repo folder or a repo id found in the Hub cache (hubcache.py); a
    usage error (exit 2) otherwise. Says on stderr which snapshot a repo led to.
    `revision_of_folder`: --revision means something for a plain folder too (fix's
    --source hub); otherwise it is refused there rather than ignored. `quiet`: say nothing
    on stderr (prestart and fix --quiet)."""
    found = resolve(value, revision)
    if found.repo_id is None:
        if revision is not None and not revision_of_folder:
            raise UsageError(
                f"--revision picks a snapshot of a Hub repo, but {value} is a folder",
                fix="leave out --revision, or give the repo id (ORG/NAME) instead of the folder",
            )
        return found.path, value
    if not output_options().as_json and not quiet:
        at = f" at {found.revision}" if found.revision else ""
        click.echo(f"qwen-kvprep: {value}{at} is the Hub cache snapshot {found.path}", err=True)
    return found.path, str(found.path)


REVISION_HELP = (
    "With a Hub repo id (ORG/NAME) or a Hub cache repo folder as DIRECTORY: the branch, tag "
    "or commit whose snapshot in the local Hub cache to use (default main)."
)


def exit_code(findings: Sequence[Finding]) -> int:
    """1 when a finding failed (with --strict, when one warned too), else 0."""
    return EXIT_FAILED if failed(findings, output_options().strict) else EXIT_OK


def finish(findings: Sequence[Finding], quiet: bool = False, **fields: object) -> NoReturn:
    """Print the findings as text (`quiet`: render.render_quiet's), or as the --json
    document with `fields` added, and exit with the code they imply."""
    if quiet and not output_options().as_json:
        emit(render_quiet(findings, result=True))  # emit removes secrets
    else:
        print_findings(findings, output_options().as_json, **fields)
    sys.exit(exit_code(findings))


def command_line_without(*dropped: str) -> str:
    """The running command's line as the user gave it (qwen-kvprep, the command, its
    arguments and the options given on the command line), less the options `dropped`:
    e.g. the command that applies what `fix --dry-run` showed, every other choice kept."""
    ctx = click.get_current_context()
    words = ctx.command_path.split()
    for param in ctx.command.params:
        name = param.name or ""
        if ctx.get_parameter_source(name) is not ParameterSource.COMMANDLINE:
            continue
        value = ctx.params.get(name)
        if isinstance(param, click.Argument):
            words.append(str(value))
        elif isinstance(param, click.Option) and not set(dropped) & set(param.opts):
            flag = max(param.opts, key=len)
            words += [flag] if param.is_flag else [flag, str(value)]
    return shlex.join(words)
