from __future__ import annotations

import click

from qwen_kvprep.commands._common import existing_dir
from qwen_kvprep.render import emit, render_revert


@click.command()
@click.argument("directory")
def revert(directory: str) -> None:
    """Undo everything `fix` did to DIRECTORY, byte for byte.

    Every recorded entry is checked first; if one cannot be restored safely nothing is
    changed and revert exits 1 saying which and why. A file changed since fix wrote it is
    left as it is (and listed), as is what another prepared folder still uses.
    """
    from qwen_kvprep.buildcache import resolve_cache_dir
    from qwen_kvprep.steps.revert import revert_checkpoint

    path = existing_dir(directory)
    emit(render_revert(path, revert_checkpoint(path), resolve_cache_dir(None)))


def register(group: click.Group) -> None:
    group.add_command(revert)
