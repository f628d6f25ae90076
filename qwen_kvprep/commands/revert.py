from __future__ import annotations

from typing import Optional

import click

from qwen_kvprep.commands._common import REVISION_HELP, checkpoint_dir, json_option, output_options
from qwen_kvprep.render import emit, render_json, render_revert, revert_json


@click.command()
@click.argument("directory")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check everything and list what would be restored and what left alone; change "
    "nothing.",
)
@click.option("--revision", metavar="REV", help=REVISION_HELP)
@json_option
def revert(directory: str, dry_run: bool, revision: Optional[str]) -> None:
    """Undo everything `fix` did to DIRECTORY, byte for byte.

    Every recorded entry is checked first; if one cannot be restored safely nothing is
    changed and revert exits 1 saying which and why. A file changed since fix wrote it is
    left as it is (and listed), as is what another prepared folder still uses. The build
    cache fix used is shared and kept.
    """
    # here, not at the top: revert's modules (the journal, filelock) cost every start of the
    # CLI, --help included, ~30 ms
    from qwen_kvprep.steps.revert import preview_revert, revert_checkpoint

    path, _ = checkpoint_dir(directory, revision)
    result = preview_revert(path) if dry_run else revert_checkpoint(path)
    if output_options().as_json:
        emit(render_json([], revert=revert_json(path, result)))
    else:
        emit(render_revert(path, result))


def register(group: click.Group) -> None:
    group.add_command(revert)
