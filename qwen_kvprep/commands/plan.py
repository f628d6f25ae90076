from __future__ import annotations

from typing import Optional

import click

from qwen_kvprep.commands._common import existing_dir, json_option, output_options
from qwen_kvprep.render import emit, render_json

DEFAULT_BATCHES = "1,4,16,32,64,100"
DEFAULT_TOKENS = "512,1024,2048,4096,8192"
# Qwen measured its published tables by generating from a one-token prompt, so the
# default runs are that too: the peak is then the decode's, set by the cache. Long prompts
# add the prefill's logits and scores; model them with --prompt-tokens/--prefill-chunk.
DEFAULT_PROMPT_TOKENS = 1


@click.command()
@click.argument("directory")
@click.option(
    "--gpu-memory",
    metavar="SIZE",
    help="Memory of the GPU to plan for: 80GiB, 24GB, 81920MiB or bytes. "
    "[default: the total of the GPU torch sees]",
)
@click.option(
    "--batch",
    "batch_list",
    metavar="LIST",
    default=DEFAULT_BATCHES,
    show_default=True,
    help="Batch sizes; the first is the one the longest context is reported at.",
)
@click.option(
    "--tokens",
    "tokens_list",
    metavar="LIST",
    default=DEFAULT_TOKENS,
    show_default=True,
    help="Tokens cached at the end of a run (prompt included); the first is the one the "
    "largest batch is reported at.",
)
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16"]),
    help="Precision the model is loaded in. [default: as config.json says; bf16 if it "
    "sets none, fp16 for GPTQ]",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=DEFAULT_PROMPT_TOKENS,
    show_default=True,
    metavar="P",
    help="Prompt length of each row; the rest of each token count is generated.",
)
@click.option(
    "--prefill-chunk",
    type=click.IntRange(min=1),
    metavar="C",
    help="Feed the prompt in forwards of C tokens. [default: the whole prompt at once]",
)
@json_option
def plan(
    directory: str,
    gpu_memory: Optional[str],
    batch_list: str,
    tokens_list: str,
    dtype: Optional[str],
    prompt_tokens: int,
    prefill_chunk: Optional[int],
) -> None:
    """Predict DIRECTORY's peak GPU memory with and without the Int8 KV cache, for each
    batch size and token count, and the largest batch and longest context that fit.

    Reads config.json and the safetensors headers only (or the index's total size, or
    the config alone, when the weights are not there); needs no GPU with --gpu-memory."""
    from qwen_kvprep.errors import UsageError
    from qwen_kvprep.planning import plan_checkpoint
    from qwen_kvprep.planning.render import payload, render_text
    from qwen_kvprep.planning.sizes import parse_int_list, parse_size

    path = existing_dir(directory)
    # options first: a typo in a list should not wait for the checkpoint to be read
    batches = parse_int_list(batch_list, "--batch")
    tokens = parse_int_list(tokens_list, "--tokens")
    short = [t for t in tokens if t < prompt_tokens]
    if short:
        raise UsageError(
            f"--tokens {short[0]} is shorter than the {prompt_tokens}-token prompt",
            fix="tokens count the prompt too: raise --tokens or lower --prompt-tokens",
        )
    memory = None
    if gpu_memory is not None:
        memory = (parse_size(gpu_memory), f"--gpu-memory {gpu_memory}")
    planned = plan_checkpoint(path, batches, tokens, memory, dtype, prompt_tokens, prefill_chunk)
    facts, result, gpu_source = planned.facts, planned.result, planned.gpu_source
    if output_options().as_json:
        emit(render_json([], plan=payload(facts, result, gpu_source)))
    else:
        emit(render_text(facts, result, gpu_source, shown=directory))


def register(group: click.Group) -> None:
    group.add_command(plan)
