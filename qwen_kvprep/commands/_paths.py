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
        converted = super().convert(value, param, ctx)
        if not self.file_okay:
            try:
                mode = os.stat(value).st_mode
            except OSError:
                return converted  # absent (created later) or unreadable: judged where used
            if not stat.S_ISDIR(mode):
                self.fail(f"{os.fspath(value)!r} is {kind_of(mode)}, not a folder", param, ctx)
        return converted
