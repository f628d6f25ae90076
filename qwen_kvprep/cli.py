"""The command line: parse, call the library, render. No logic of its own.

Every expected failure is a KvprepError; `main` maps it (and click's usage errors) to a
message and an exit code in one place, so no traceback reaches the user without --debug.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import click

from qwen_kvprep import __version__
from qwen_kvprep.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, KvprepError, UsageError
from qwen_kvprep.findings import Finding, failed
from qwen_kvprep.redact import scrub, scrub_findings, scrub_obj
from qwen_kvprep.report import emit, render_human, render_json, use_colour


class Ctx:
    def __init__(self, debug: bool) -> None:
        self.debug = debug


def existing_dir(value: Optional[str]) -> Optional[Path]:
    if value is None:
        return None
    path = Path(value)
    if not path.exists():
        raise UsageError(f"no such directory: {value}")
    if not path.is_dir():
        raise UsageError(f"not a directory: {value}")
    return path.absolute()


def output_findings(
    findings: Sequence[Finding], as_json: bool, strict: bool = False, **extra: Any
) -> int:
    """Print findings in the chosen form and return the exit code they imply."""
    # Secrets (values of *TOKEN*/*KEY*/*SECRET*/*PASSWORD* variables, hf_ tokens) never
    # reach any output, whichever check or step put them into a message.
    findings = scrub_findings(findings)
    extra = scrub_obj(extra)
    if as_json:
        emit(render_json(findings, **extra))
    else:
        emit(render_human(findings, colour=use_colour(sys.stdout)))
    return EXIT_FAILED if failed(findings, strict) else EXIT_OK


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="qwen-kvprep")
@click.option("--debug", is_flag=True, help="Show Python tracebacks for failures.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Make the Int8 KV cache of Qwen (v1) chat models work."""
    ctx.obj = Ctx(debug)


# Commands live in qwen_kvprep/commands/*.py and attach themselves to `cli`.
from qwen_kvprep import commands as _commands  # noqa: E402

_commands.register(cli)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        code = cli.main(args=args, prog_name="qwen-kvprep", standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.Abort:
        click.echo("Aborted.", err=True)
        code = EXIT_FAILED
    except click.ClickException as exc:
        exc.show()
        code = EXIT_USAGE
    except KvprepError as exc:
        if debug:
            raise
        code = report_error(exc, as_json="--json" in args)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        code = 130
    except Exception as exc:  # a bug, not an expected failure: short message unless --debug
        if debug:
            raise
        click.echo(f"qwen-kvprep: internal error: {type(exc).__name__}: {exc}", err=True)
        click.echo("  this is a bug: rerun with --debug and report the traceback", err=True)
        code = EXIT_FAILED
    sys.exit(code if isinstance(code, int) else EXIT_OK)


def report_error(exc: KvprepError, as_json: bool) -> int:
    findings = scrub_findings(exc.findings)
    message, fix = scrub(exc.message), scrub(exc.fix) if exc.fix else None
    if as_json:
        from qwen_kvprep.report import document

        doc = document(findings, error={"message": message, "fix": fix})
        doc["ok"] = False
        emit(json.dumps(doc, indent=2, default=str))
    else:
        if findings:
            emit(render_human(findings, colour=use_colour(sys.stderr)), sys.stderr)
        click.echo(f"error: {message}", err=True)
        if fix:
            click.echo(f"  fix: {fix}", err=True)
    return exc.exit_code
