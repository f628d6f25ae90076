"""click.Path for the options that name a path on this machine."""

from __future__ import annotations

import os
import stat
from typing import Optional, Union

import click

from qwen_kvprep.untrusted import kind_of

EMPTY = "must not be empty (an unset shell variable?)"


class NonEmptyPath(click.Path):
    """click.Path that refuses "" (click reads it as the current folder) and, for a folder,
    anything there that is not one: click refuses only a regular file (a usage error), and
    a FIFO or a device would otherwise fail later, with another exit code."""

    def convert(
        self,
        value: Union[str, os.PathLike[str]],
        param: Optional[click.Parameter],
        ctx: Optional[click.Context],
    ) -> Union[str, bytes, os.PathLike[str]]:
        if isinstance(value, str) and not value.strip():
            self.fail(EMPTY, param, ctx)
        if not self.file_okay:  # before click's own check, which says only "is a file"
            try:
                mode = os.stat(value).st_mode
            except OSError:
                mode = stat.S_IFDIR  # absent (created later) or unreadable: judged where used
            if not stat.S_ISDIR(mode):
                what = "a file" if stat.S_ISREG(mode) else kind_of(mode)
                self.fail(f"{_named(param, ctx)}{os.fspath(value)!r} is {what}, not a folder",
                          param, ctx)
        return super().convert(value, param, ctx)


def _named(param: Optional[click.Parameter], ctx: Optional[click.Context]) -> str:
    """"$VAR: " when the value came from an environment variable (click's message names
    only the option)."""
    envvar = getattr(param, "envvar", None)
    if ctx is None or param is None or param.name is None or not isinstance(envvar, str):
        return ""
    source = getattr(ctx, "get_parameter_source", lambda _name: None)(param.name)
    return f"${envvar}: " if getattr(source, "name", "") == "ENVIRONMENT" else ""
