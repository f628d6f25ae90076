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


def own_args(args: Sequence[str]) -> list[str]:
    """The arguments that are ours: everything before the first `--` (after it comes
    prestart's CMD, whose `--json` or `--debug` are its own business)."""
    args = list(args)
    return args[: args.index("--")] if "--" in args else args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    ours = own_args(args)
    debug = "--debug" in ours
    as_json = "--json" in ours
    from qwen_kvprep.redact import install_log_filter

    install_log_filter()  # what libraries log goes through the same redaction
    try:
        code = cli.main(args=args, prog_name="qwen-kvprep", standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.Abort:
        click.echo("Aborted.", err=True)
        code = EXIT_FAILED
    except click.ClickException as exc:
        if scrub(exc.format_message()) != exc.format_message():
            click.echo(f"Error: {scrub(exc.format_message())}", err=True)
        else:
            exc.show()
        code = EXIT_USAGE
    except KvprepError as exc:
        if debug:
            raise
        code = report_error(exc, as_json=as_json)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        code = 130
    except OSError as exc:
        # a file-system refusal no command mapped itself: still something to act on
        if debug:
            raise
        from qwen_kvprep.errors import os_failure

        code = report_error(os_failure(exc), as_json=as_json)
    except Exception as exc:  # a bug, not an expected failure: short message unless --debug
        if debug:
            raise
        text = scrub(f"{type(exc).__name__}: {exc}")
        click.echo(f"qwen-kvprep: internal error: {text}", err=True)
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
