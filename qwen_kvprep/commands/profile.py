from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from qwen_kvprep.commands._common import (
    REVISION_HELP,
    checkpoint_dir,
    finish,
    json_option,
    output_options,
)
from qwen_kvprep.commands._numbers import FiniteFloatRange
from qwen_kvprep.profile import (
    BUILTIN_PASSAGE,
    ProfileOptions,
    parse_batches,
    profile_and_plot,
    quality_file,
)
from qwen_kvprep.profile.progress import progress_bar
from qwen_kvprep.profile.protocol import DEFAULT_PROMPT_TOKENS, DEFAULT_TIMEOUT_S, DEVICES, DTYPES
from qwen_kvprep.render import emit


@click.command()
@click.argument("directory")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="Where to run; auto = the GPU when torch sees one.")
@click.option("--batch", "batch", metavar="LIST",
              help="Batch sizes, e.g. 1,4,16 (default: 1,4,16,32,64,100 on a GPU, 1,2 on a "
              "CPU).")
@click.option("--tokens", type=click.IntRange(min=1), metavar="N",
              help="New tokens generated per run (default: 1024 on a GPU, 16 on a CPU).")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=DEFAULT_PROMPT_TOKENS,
              show_default=True, metavar="P", help="Prompt length in tokens.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), metavar="C",
              help="Feed the prompt in chunks of C tokens (default: all at once).")
@click.option("--random-weights", is_flag=True,
              help="Build the architecture from config.json with random weights on the "
              "device: no weights needed.")
@click.option("--dtype", type=click.Choice(DTYPES),
              help="Model dtype (default: as config.json says).")
@click.option("--quality", is_flag=False, flag_value=BUILTIN_PASSAGE, default=None,
              metavar="[TEXTFILE]",
              help="Also compare the two caches teacher-forced over a text (the built-in "
              "passage, or TEXTFILE).")
@click.option("--timeout", type=FiniteFloatRange(min=1.0), default=DEFAULT_TIMEOUT_S,
              show_default=True, metavar="S", help="Seconds one run may take before it is "
              "killed.")
@click.option("--no-cudnn-attention", "no_cudnn_attention", is_flag=True,
              help="Turn torch's cuDNN attention backend off in every run (a fairer "
              "unquantized baseline where cuDNN re-plans for every new cached length).")
@click.option("--no-fast-path", "no_fast_path", is_flag=True,
              help="Int8 runs use the model's own quantized-cache code even where fix "
              "installed qwen-kvprep's fast path (to measure what it buys).")
@click.option("--revision", metavar="REV", help=REVISION_HELP)
@json_option
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Draw memory against batch into FILE (.svg or .png; needs the plot "
              "extra).")
def profile(
    directory: str,
    device: str,
    batch: Optional[str],
    tokens: Optional[int],
    prompt_tokens: int,
    prefill_chunk: Optional[int],
    random_weights: bool,
    dtype: Optional[str],
    quality: Optional[str],
    timeout: float,
    no_cudnn_attention: bool,
    no_fast_path: bool,
    revision: Optional[str],
    plot: Optional[Path],
) -> None:
    """Measure DIRECTORY's memory, speed and quality with the unquantized and the Int8
    KV cache, one child process per batch size and mode, beside plan's prediction."""
    # here, not at the top: the profile's tables and plot cost every start of the CLI, --help
    # included, ~25-60 ms
    from qwen_kvprep.profile.plot import check_plot_target
    from qwen_kvprep.profile.tables import render_text

    as_json = output_options().as_json
    path, _ = checkpoint_dir(directory, revision)
    text_file = quality_file(quality)
    if plot is not None:
        check_plot_target(plot)
    options = ProfileOptions(
        device=device,
        batches=parse_batches(batch),
        new_tokens=tokens,
        prompt_tokens=prompt_tokens,
        prefill_chunk=prefill_chunk,
        random_weights=random_weights,
        dtype=dtype,
        quality=quality is not None,
        quality_text=text_file,
        timeout=timeout,
        cudnn_attention=not no_cudnn_attention,
        fast_path=not no_fast_path,
    )
    bar = progress_bar(as_json, total=1)
    try:
        report = profile_and_plot(path, options, bar, plot)
    finally:
        if bar is not None:
            bar.close()
    if not as_json:
        emit(render_text(report.profile) + "\n")
    finish(report.findings, profile=report.profile)


def register(group: click.Group) -> None:
    group.add_command(profile)
