from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from qwen_kvprep.commands._common import REVISION_HELP, checkpoint_dir, json_option, output_options
from qwen_kvprep.errors import UsageError
from qwen_kvprep.render import emit, render_json

DEFAULT_BATCHES = "1,4,16,32,64,100"
DEFAULT_TOKENS = "512,1024,2048,4096,8192"
# Qwen measured its published tables by generating from a one-token prompt, so the
# default runs are that too: the peak is then the decode's, set by the cache. Long prompts
# add the prefill's logits and scores; model them with --prompt-tokens/--prefill-chunk.
DEFAULT_PROMPT_TOKENS = 1
# planning.split.MAX_GPUS, written out: the CLI's start does not import the planning package
MAX_GPUS = 64


@click.command()
@click.argument("directory", required=False)
@click.option(
    "--gpu",
    "gpu_name",
    metavar="NAME",
    help="The card to plan for, by name: h100, h200, a100-80g, a100-40g, l40s, l4, a10g, "
    "v100-32g, 4090, 3090, 5090 (with the memory torch reports on it); `--gpu list` "
    "shows them. [default: the GPU torch sees]",
)
@click.option(
    "--gpu-memory",
    metavar="SIZE",
    help="Or the GPU's memory with a unit: 80Gi, 80GiB or 80GB (binary: 2^30 bytes a GB, "
    "as docker reads it and as a card's label means it), 80G (Kubernetes: 10^9), "
    "81920Mi. A bare number is refused.",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1, max=MAX_GPUS),
    default=1,
    show_default=True,
    metavar="N",
    help="Cards of that memory holding the model, split as transformers' "
    'device_map="auto" splits it (whole decoder blocks, balanced; each block\'s KV cache '
    "on its card).",
)
@click.option("--batch", "batch_list", metavar="LIST", default=DEFAULT_BATCHES,
              show_default=True,
              help="Batch sizes; the first is the one the longest context is reported at.")
@click.option("--tokens", "tokens_list", metavar="LIST", default=DEFAULT_TOKENS,
              show_default=True,
              help="Tokens cached at the end of a run (prompt included); the first is the "
              "one the largest batch is reported at.")
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16"]),
    help="Precision the model is loaded in. [default: as config.json says; bf16 if it "
    "sets none, fp16 for GPTQ]",
)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=DEFAULT_PROMPT_TOKENS,
              show_default=True, metavar="P",
              help="Prompt length of each row; the rest of each token count is generated.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), metavar="C",
              help="Feed the prompt in forwards of C tokens. [default: the whole prompt at "
              "once]")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="Also draw the predicted peaks against batch and against tokens into FILE "
    "(.svg, drawn by qwen-kvprep itself; .png needs matplotlib).",
)
@click.option("--revision", metavar="REV", help=REVISION_HELP)
@json_option
def plan(
    directory: Optional[str],
    gpu_name: Optional[str],
    gpu_memory: Optional[str],
    gpus: int,
    batch_list: str,
    tokens_list: str,
    dtype: Optional[str],
    prompt_tokens: int,
    prefill_chunk: Optional[int],
    plot: Optional[Path],
    revision: Optional[str],
) -> None:
    """Predict DIRECTORY's peak GPU memory with and without the Int8 KV cache, for each
    batch size and token count, and the largest batch and longest context that fit.

    Reads config.json and the safetensors headers only (or the index's total size, or
    the config alone, when the weights are not there); needs no GPU with --gpu or
    --gpu-memory. `plan --gpu list` lists the cards --gpu knows."""
    # here, not at the top: planning's tables and the GPU list cost every start of the CLI,
    # --help included, ~35 ms
    from qwen_kvprep.planning import plan_checkpoint, plan_document, plan_inputs, plan_text
    from qwen_kvprep.planning.gpu import cards_json, render_cards

    as_json = output_options().as_json
    if gpu_name is not None and gpu_name.strip().lower() == "list":
        emit(render_json([], gpus=cards_json()) if as_json else render_cards())
        return
    if directory is None:
        raise UsageError("plan needs the model directory",
                         fix="qwen-kvprep plan DIR --gpu a100-80g (or --gpu-memory 80Gi)")
    path, _ = checkpoint_dir(directory, revision)
    batches, tokens, memory = plan_inputs(gpu_name, gpu_memory, batch_list, tokens_list,
                                          prompt_tokens, plot)
    planned = plan_checkpoint(
        path, batches, tokens, memory, dtype, prompt_tokens, prefill_chunk, plot, gpus
    )
    emit(render_json(planned.findings, plan=plan_document(planned)) if as_json
         else plan_text(planned, shown=directory))


def register(group: click.Group) -> None:
    group.add_command(plan)
