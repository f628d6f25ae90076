"""prestart's command line: CMD is everything after the first `--`."""

from __future__ import annotations

from typing import Optional

import click

from qwen_kvprep.errors import UsageError
from qwen_kvprep.quickstart import ENV_DIR

COMMAND_KEY = "qwen_kvprep.prestart.command"
DASHES_KEY = "qwen_kvprep.prestart.dashes"


class CommandAfterDashes(click.Command):
    """prestart's parser: everything after the first `--` is CMD, taken whole before click
    parses the rest (in `ctx.meta`): click would otherwise give CMD's first word to DIR
    when DIR comes from $QWEN_KVPREP_DIR, and read CMD's own options as ours."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        command: list[str] = []
        ctx.meta[DASHES_KEY] = "--" in args
        if "--" in args:
            cut = args.index("--")
            args, command = args[:cut], args[cut + 1 :]
        ctx.meta[COMMAND_KEY] = command
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if "extra argument" not in exc.message:
                raise
            hint = "; put the command after `--`: prestart DIR -- CMD ARGS..."
            raise click.UsageError(exc.message + hint, ctx) from None


def command_after_dashes(
    ctx: click.Context, directory: Optional[str]
) -> tuple[str, list[str]]:
    """DIR and CMD, as CommandAfterDashes took it (empty without `--`); a usage error
    without DIR or with nothing after `--`."""
    if directory is None:
        raise UsageError(
            "prestart needs the model directory",
            fix=f"qwen-kvprep prestart DIR -- CMD ..., or set {ENV_DIR}",
        )
    command: list[str] = ctx.meta.get(COMMAND_KEY, [])
    if ctx.meta.get(DASHES_KEY) and not command:
        # an image whose CMD is empty: starting nothing and exiting 0 would look like a
        # server that stopped cleanly
        raise UsageError(
            "nothing after `--`: prestart starts the command that follows it",
            fix="put the server command after `--`: qwen-kvprep prestart DIR -- python3 -m "
            "your_server (in an image: give it a CMD); to only prepare DIR, leave out `--`",
        )
    return directory, command
