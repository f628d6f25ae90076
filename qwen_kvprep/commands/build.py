from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from qwen_kvprep.commands._common import cache_dir_option, finish, json_option


@click.command()
@click.option(
    "--arch",
    metavar="LIST",
    help='GPU architectures, e.g. "8.0;9.0" or "8.6+PTX" (default: TORCH_CUDA_ARCH_LIST, '
    "else the visible GPUs, else every architecture the installed nvcc supports).",
)
@cache_dir_option()
@click.option(
    "--source-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Build the kernel sources in this folder (default: qwen-kvprep's own).",
)
@click.option("--force", is_flag=True, help="Rebuild even if the cache has this build.")
@click.option(
    "--lock-timeout",
    type=float,
    metavar="SECONDS",
    help="Longest wait for another build of the same key (default: "
    "$QWEN_KVPREP_LOCK_TIMEOUT, else 600).",
)
@json_option
def build(
    arch: Optional[str],
    cache_dir: Optional[str],
    source_dir: Optional[Path],
    force: bool,
    lock_timeout: Optional[float],
) -> None:
    """Compile the KV-cache extension for this torch into the build cache.

    No GPU is needed. One build per ABI (torch, CUDA, Python, architectures, sources) is
    kept; an existing one is reused in milliseconds. Without nvcc, or with a CPU build of
    torch, this is a CPU-only build (said plainly).
    """
    from qwen_kvprep.steps.build import build_into_cache

    built = build_into_cache(
        source_dir, arch, Path(cache_dir) if cache_dir else None, force, lock_timeout)
    finish(built.findings, **built.to_json())


def register(group: click.Group) -> None:
    group.add_command(build)
