from __future__ import annotations

import click


@click.command()
@click.argument("directory")
def revert(directory: str) -> None:
    """Undo everything `fix` did to DIRECTORY, byte for byte."""
    from qwen_kvprep.cli import existing_dir
    from qwen_kvprep.steps.revert import revert_checkpoint

    path = existing_dir(directory)
    assert path is not None
    restored = revert_checkpoint(path)
    if not restored:
        click.echo(f"nothing to revert: qwen-kvprep has not changed {path}")
        return
    click.echo(f"restored {len(restored)} file(s) in {path}:")
    for item in restored:
        click.echo(f"  {item}")
    from qwen_kvprep.buildcache import resolve_cache_dir

    # builds are per ABI, not per checkpoint: other checkpoints may load the same one
    click.echo(f"the shared build cache {resolve_cache_dir(None)} is kept (builds are shared)")


def register(group: click.Group) -> None:
    group.add_command(revert)
