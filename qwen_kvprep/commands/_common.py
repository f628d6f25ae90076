"""What the commands share: the output options click's context carries, the directory
arguments, and the end of a command that prints findings."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn, Optional, TypeVar, overload

import click

from qwen_kvprep.errors import EXIT_FAILED, EXIT_OK, UsageError
from qwen_kvprep.findings import Finding, failed
from qwen_kvprep.render import print_findings

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


def cache_dir_option(
    *, envvar: Optional[str] = None, image_default: Optional[str] = None
) -> Callable[[F], F]:
    """--cache-dir, the build cache, for every command that takes it: a folder on this
    machine (a string; unset, the build cache reads $QWEN_KVPREP_CACHE itself). prestart
    also takes the variable as the option's value (`envvar`), as its fast path does;
    `template` names the folder inside the image it writes (`image_default`)."""
    if image_default is not None:
        help = "Build cache folder inside the image (docker)."
    else:
        help = (
            "Build cache folder, shared by replicas (default: $QWEN_KVPREP_CACHE, else "
            "~/.cache/qwen-kvprep)." + (f" [env: {envvar}]" if envvar else "")
        )
    return click.option(
        "--cache-dir",
        metavar="DIR",
        # a folder of this machine (checked by click), or one inside the image
        type=click.Path(file_okay=False) if image_default is None else None,
        envvar=envvar,
        default=image_default,
        show_default=image_default is not None,
        help=help,
    )


@overload
def existing_dir(value: str) -> Path: ...
@overload
def existing_dir(value: None) -> None: ...
@overload
def existing_dir(value: Optional[str]) -> Optional[Path]: ...
def existing_dir(value: Optional[str]) -> Optional[Path]:
    """DIRECTORY as an absolute path; a usage error (exit 2) when it is not a directory."""
    if value is None:
        return None
    path = Path(value)
    if not path.exists():
        raise UsageError(f"no such directory: {value}")
    if not path.is_dir():
        raise UsageError(f"not a directory: {value}")
    return path.absolute()


def exit_code(findings: Sequence[Finding]) -> int:
    """1 when a finding failed (with --strict, when one warned too), else 0."""
    return EXIT_FAILED if failed(findings, output_options().strict) else EXIT_OK


def finish(findings: Sequence[Finding], **fields: object) -> NoReturn:
    """Print the findings as text, or as the --json document with `fields` added, and exit
    with the code they imply."""
    print_findings(findings, output_options().as_json, **fields)
    sys.exit(exit_code(findings))
