from __future__ import annotations

import click

from qwen_kvprep.report import emit


@click.command()
@click.argument("directory")
def revert(directory: str) -> None:
    """Undo everything `fix` did to DIRECTORY, byte for byte.

    Every recorded entry is checked first; if one cannot be restored safely nothing is
    changed and revert exits 1 saying which and why. A file changed since fix wrote it is
    left as it is (and listed), as is what another prepared folder still uses.
    """
    from qwen_kvprep.cli import existing_dir
    from qwen_kvprep.steps.revert import revert_checkpoint

    path = existing_dir(directory)
    assert path is not None
    result = revert_checkpoint(path)
    if result.temps:
        emit(f"removed leftover temporary files: {', '.join(sorted(result.temps))}")
    if not result.done and not result.notes:
        emit(f"nothing to revert: qwen-kvprep has not changed {path}")
        return
    if result.done:
        emit(f"restored {len(result.done)} file(s) in {path}:")
        for item in result.done:
            emit(f"  {item}")
    else:
        emit(f"nothing to restore in {path}")
    if result.notes:
        emit("left alone:")
        for note in result.notes:
            emit(f"  {note}")
    from qwen_kvprep.buildcache import resolve_cache_dir

    # builds are per ABI, not per checkpoint: other checkpoints may load the same one
    emit(f"the shared build cache {resolve_cache_dir(None)} is kept (builds are shared)")


def register(group: click.Group) -> None:
    group.add_command(revert)
