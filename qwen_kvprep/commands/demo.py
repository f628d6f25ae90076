from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import click

from qwen_kvprep.commands._common import (
    command_line_without,
    finish,
    json_option,
    output_options,
)
from qwen_kvprep.commands._numbers import FiniteFloatRange
from qwen_kvprep.commands._options import cache_dir_option
from qwen_kvprep.render import emit, render_demo
from qwen_kvprep.smoke.progress import wants_progress


@click.command()
@click.argument("directory", required=False)
@cache_dir_option()
@click.option(
    "--smoke-timeout",
    type=FiniteFloatRange(min=1.0),
    metavar="S",
    help="Seconds the smoke child may take before it is killed.",
)
@click.option(
    "--gptq",
    is_flag=True,
    help="An Int4 GPTQ checkpoint, as Qwen's -Int4 repos ship (needs the GPTQ backend: "
    "docs/reference.md, Int4 GPTQ checkpoints).",
)
@json_option
def demo(
    directory: Optional[str],
    cache_dir: Optional[str],
    smoke_timeout: Optional[float],
    gptq: bool,
) -> None:
    """See the whole Int8 KV-cache path work on a tiny generated model, in about a minute.

    Generates a tiny Qwen (v1) compatible checkpoint (no download), runs `fix` on it
    (build and smoke included) and explains what happened and what was measured.
    DIRECTORY keeps everything (checkpoint, HF caches); without it a temporary folder is
    used and removed. The compiled extension goes to the normal build cache, where a real
    `fix` finds it.
    """
    # here, not at the top: the demo runs all of fix; its modules cost every start of the
    # CLI, --help included, ~70 ms
    from qwen_kvprep.demo import DemoOptions, run_demo

    as_json = output_options().as_json
    progress = wants_progress(as_json)
    echo = (lambda text: print(f"demo: {text}", file=sys.stderr, flush=True)) if progress else None
    result = run_demo(
        DemoOptions(
            directory=Path(directory) if directory else None,
            cache_dir=Path(cache_dir) if cache_dir else None,
            progress=progress,
            smoke_timeout=smoke_timeout,
            gptq=gptq,
            rerun=command_line_without("--smoke-timeout", "--json"),
        ),
        echo,
    )
    if as_json:
        finish(result.findings, demo=result.to_json())
    emit(render_demo(result))
    sys.exit(0 if result.ok else 1)


def register(group: click.Group) -> None:
    group.add_command(demo)
