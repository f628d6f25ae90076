"""Options several commands share, declared once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, TypeVar

import click
from click.core import ParameterSource

from qwen_kvprep.commands._paths import EMPTY as _EMPTY
from qwen_kvprep.commands._paths import NonEmptyPath as NonEmptyPath  # build, template
from qwen_kvprep.common import ARCH_LIST_FIX, read_arch_list
from qwen_kvprep.errors import UsageError

F = TypeVar("F", bound=Callable[..., object])


if TYPE_CHECKING:  # generic in the click releases that ship type hints, not in 8.0
    _TextType = click.ParamType[str]
else:
    _TextType = click.ParamType



class _NonEmpty(_TextType):
    """A value that must not be "": given as an unset shell variable (`--fetch "$LOCK"`,
    `-o "$VIEW"`), it would read as the option left out, or as the current folder."""

    name = "text"

    def convert(
        self, value: str, param: Optional[click.Parameter], ctx: Optional[click.Context]
    ) -> str:
        if isinstance(value, str) and not value.strip():
            self.fail(_EMPTY, param, ctx)
        return value


NONEMPTY = _NonEmpty()


quiet_option = click.option(
    "-q", "--quiet", is_flag=True,
    help="Print only the result: what needs attention (warnings and failures, with their "
    "fixes) and the outcome; no progress on stderr.",
)


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
            "$XDG_CACHE_HOME/qwen-kvprep, else ~/.cache/qwen-kvprep)."
            + (f" [env: {envvar}]" if envvar else "")
        )
    return click.option(
        "--cache-dir",
        metavar="DIR",
        # a folder of this machine (checked by click), or one inside the image
        type=NonEmptyPath(file_okay=False) if image_default is None else None,
        envvar=envvar,
        default=image_default,
        show_default=image_default is not None,
        help=help,
    )


def arch_option(help: str, *, envvar: Optional[str] = None) -> Callable[[F], F]:
    """--arch LIST for the commands that build (fix, build, prestart), read as click reads
    it: a list the build could not read is a usage error here, on any machine, rather than
    on the first one with CUDA (a CPU torch builds no architectures and reads none)."""
    return click.option(
        "--arch", metavar="LIST", envvar=envvar, callback=_check_arch, help=help
    )


def _check_arch(
    ctx: click.Context, param: click.Parameter, value: Optional[str]
) -> Optional[str]:
    # blank means none given, as before (and as torch reads an empty TORCH_CUDA_ARCH_LIST)
    if value is None or not value.strip():
        return value
    envvar = param.envvar if isinstance(param.envvar, str) else None
    from_env = ctx.get_parameter_source(param.name or "") == ParameterSource.ENVIRONMENT
    try:
        read_arch_list(value, envvar if from_env and envvar else "--arch")
    except ValueError as exc:
        raise UsageError(str(exc), fix=ARCH_LIST_FIX) from None
    return value  # as given: the build reads it again, with its other inputs



def check_seconds(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> object:
    """A number of seconds given as an option (type=str: the text as typed, which a refusal
    quotes; 1e309 read as a float first would be quoted as 'inf'), refused (nan, inf,
    negative) before any work."""
    from qwen_kvprep.buildcache.lock import seconds

    name = "--" + (param.name or "").replace("_", "-")
    return None if value is None else seconds(value, name)
