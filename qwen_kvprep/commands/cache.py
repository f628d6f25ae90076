"""`qwen-kvprep cache list` and `cache prune`: what the build cache holds and who uses it
(buildcache/inventory.py)."""

from __future__ import annotations

from typing import Optional

import click

from qwen_kvprep.buildcache import inventory as lib
from qwen_kvprep.commands._common import debug_option, json_option, output_options
from qwen_kvprep.commands._options import cache_dir_option
from qwen_kvprep.render import emit, render_json


@click.group()
def cache() -> None:
    """Inspect and prune the build cache (builds, who uses them, leftovers)."""


@cache.command("list")
@cache_dir_option()
@json_option
@debug_option
def list_builds(cache_dir: Optional[str]) -> None:
    """One row per build: key, origin, torch/CUDA/Python, size, created, last chosen and
    the prepared folders that use it (each checked against the folder's own state);
    then the leftovers in tmp/ and logs/ and the total. Changes nothing."""
    inventory = lib.take_inventory(lib.layout_for(cache_dir))
    if output_options().as_json:
        emit(render_json([], cache=inventory.to_json()))
    else:
        emit(lib.inventory_text(inventory))


@cache.command()
@cache_dir_option()
@click.option("--dry-run", is_flag=True,
              help="List what would be removed and the bytes it would free; change nothing.")
@click.option("--keep", "keep", multiple=True, metavar="KEY",
              help="Keep this build whoever uses it (a key, or its first 12 or more "
              "characters); repeatable. For users prune cannot see: a read-only cache's, "
              "folders on another machine.")
@json_option
@debug_option
def prune(cache_dir: Optional[str], dry_run: bool, keep: tuple[str, ...]) -> None:
    """Remove the builds no prepared folder uses (and those of older versions), the
    records of folders that no longer use a build, leftovers of killed runs in tmp/ and
    logs older than a week. A build whose lock is held (being built or installed) is kept.
    Only a folder qwen-kvprep made a build cache is pruned; nothing is followed through a
    link. Asks nothing: run it from scripts and images; see what would go with --dry-run."""
    result = lib.prune(lib.layout_for(cache_dir), dry_run=dry_run, keep=keep)
    if output_options().as_json:
        emit(render_json([], prune=result.to_json()))
    else:
        emit(lib.prune_text(result))


def register(group: click.Group) -> None:
    group.add_command(cache)
