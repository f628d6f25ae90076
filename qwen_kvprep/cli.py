"""The command line: the click group and its global options, and the one place where
failures become messages and exit codes.

Every expected failure is a KvprepError; `main` maps it (and OSErrors, click's usage
errors, Ctrl-C and bugs) to a message and an exit code, so no traceback reaches the user
without --debug. Whether that message is text or a JSON document is what the command line
said: click's context object carries --json and --debug (commands/_common.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Optional

import click

from qwen_kvprep import __version__
from qwen_kvprep.commands import register
from qwen_kvprep.commands._common import OutputOptions, debug_option, json_option
from qwen_kvprep.errors import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    KvprepError,
    UsageError,
    os_failure,
)
from qwen_kvprep.redact import install_log_filter, scrub
from qwen_kvprep.render import report_error

__all__ = ["cli", "main"]


def _version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """--version: qwen-kvprep's and what a bug report needs beside it, read from the
    installed packages' metadata (importing torch would take seconds)."""
    if not value or ctx.resilient_parsing:
        return
    import importlib.metadata
    import platform

    def installed(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    others = ", ".join(f"{n} {installed(n)}" for n in ("torch", "transformers", "huggingface-hub"))
    click.echo(f"qwen-kvprep {__version__} ({others}, Python {platform.python_version()})")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show the versions of qwen-kvprep, torch, transformers, huggingface-hub "
              "and Python, and exit.")
@debug_option
@json_option
def cli() -> None:
    """Make the Int8 KV cache of Qwen (v1) chat models work.

    --debug and --json may come before or after the command."""


register(cli)


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def _interrupted() -> int:
    click.echo("qwen-kvprep: interrupted", err=True)
    return EXIT_INTERRUPTED


def _asks_for_json(args: Sequence[str]) -> bool:
    """--json among qwen-kvprep's own arguments (prestart's CMD, after `--`, has its own)."""
    own = args[: list(args).index("--")] if "--" in args else args
    return "--json" in own


def _usage_error(exc: click.ClickException) -> UsageError:
    ctx = getattr(exc, "ctx", None)
    help_command = f"{ctx.command_path} --help" if ctx is not None else "qwen-kvprep --help"
    return UsageError(exc.format_message(), fix=f"see `{help_command}`")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _run(args)
    except BrokenPipeError:
        # `qwen-kvprep fix --bad --json | head -1`: the reader has what it wanted. As click
        # does for the commands: exit 1, quietly, with stdout pointed at /dev/null so that
        # the interpreter's last flush does not fail again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_FAILED
    sys.exit(code)


def _run(args: list[str]) -> int:
    options = OutputOptions()
    install_log_filter()  # what libraries log goes through the same redaction
    try:
        code = cli.main(args=args, prog_name="qwen-kvprep", standalone_mode=False, obj=options)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.Abort as exc:
        # click turns Ctrl-C into Abort ("Aborted.", exit 1); a shell's convention is 130,
        # and every write we make is atomic, so there is nothing half-written to report
        # (click >= 8.1 chains the KeyboardInterrupt as the cause, 8.0 only as the context)
        if isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):
            code = _interrupted()
        else:
            click.echo("Aborted.", err=True)
            code = EXIT_FAILED
    except click.ClickException as exc:
        if options.as_json or _asks_for_json(args):
            # the document a script parses, also when click stopped before reading --json
            code = report_error(_usage_error(exc), as_json=True)
        elif scrub(exc.format_message()) != exc.format_message():
            click.echo(f"Error: {scrub(exc.format_message())}", err=True)
            code = EXIT_USAGE
        else:
            exc.show()
            code = EXIT_USAGE
    except KvprepError as exc:
        if options.debug:
            raise
        code = report_error(exc, as_json=options.as_json)
    except KeyboardInterrupt:
        code = _interrupted()
    except BrokenPipeError:
        raise  # stdout is gone: nothing to report it on (main)
    except OSError as exc:
        # a file-system refusal no command mapped itself: still something to act on
        if options.debug:
            raise
        code = report_error(os_failure(exc), as_json=options.as_json)
    except Exception as exc:  # a bug, not an expected failure: short message unless --debug
        if options.debug:
            raise
        text = scrub(f"{type(exc).__name__}: {exc}")
        click.echo(f"qwen-kvprep: internal error: {text}", err=True)
        click.echo("  this is a bug: rerun with --debug and report the traceback", err=True)
        code = EXIT_FAILED
    return code if isinstance(code, int) else EXIT_OK
