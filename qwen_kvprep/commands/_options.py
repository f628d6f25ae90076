"""Options several commands share, declared once."""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import click

F = TypeVar("F", bound=Callable[..., object])


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
