from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import click

from qwen_kvprep.commands._common import (
    REVISION_HELP,
    checkpoint_dir,
    command_line_without,
    finish,
    json_option,
    output_options,
)
from qwen_kvprep.commands._numbers import FiniteFloatRange
from qwen_kvprep.commands._smoke import device_available, engine_smoke
from qwen_kvprep.engines.protocol import ENGINES
from qwen_kvprep.findings import warn
from qwen_kvprep.provenance import ours
from qwen_kvprep.smoke import SmokeOptions, smoke_and_record
from qwen_kvprep.smoke.progress import log_phases, phase_progress, step_log
from qwen_kvprep.smoke.protocol import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_PROMPT,
    DEFAULT_TIMEOUT_S,
    DEVICES,
)
from qwen_kvprep.smoke.runner import load_path_for
from qwen_kvprep.steps.validate import check as validate_checkpoint


@click.command()
@click.argument("directory")
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default="auto",
    show_default=True,
    help="Where to load the model; auto = the GPU when torch sees one.",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1, 4096),
    default=DEFAULT_MAX_NEW_TOKENS,
    show_default=True,
    help="Greedy tokens generated with each cache.",
)
@click.option(
    "--prompt",
    metavar="TEXT",
    callback=lambda _ctx, _param, value: _prompt(value),
    help=f"Prompt text (default: {DEFAULT_PROMPT!r}).",
)
@click.option(
    "--timeout",
    type=FiniteFloatRange(min=1.0),
    default=DEFAULT_TIMEOUT_S,
    show_default=True,
    metavar="S",
    help="Seconds before the child process is killed and the smoke fails.",
)
@click.option("--revision", metavar="REV", help=REVISION_HELP)
@click.option("--engine", type=click.Choice(ENGINES), default="transformers", show_default=True,
              help="On a folder convert wrote: load it as this engine serves it and compare "
              "with transformers and the original, in float32 (vllm: also its KV caches).")
@json_option
def smoke(
    directory: str,
    device: str,
    max_new_tokens: int,
    prompt: Optional[str],
    timeout: float,
    revision: Optional[str],
    engine: str,
) -> None:
    """Prove DIRECTORY's Int8 KV cache works: load it as a server would (in a child
    process), check every layer uses the quantized cache through the compiled kernel,
    compare greedy output with the unquantized cache, and measure what it saves."""
    path, spelt = checkpoint_dir(directory, revision)
    if engine != "transformers" or ours(path):
        engine_smoke(path, engine, max_new_tokens, timeout, prompt=prompt, device=device)
    # what would make the child fail for a reason that is not the cache's, said before it
    # starts (a failed smoke replaces a passing verdict in the state)
    validate_checkpoint(path)
    device_available(device)
    load_path, problem = load_path_for(spelt)
    options = SmokeOptions(
        device=device, max_new_tokens=max_new_tokens,
        prompt=prompt if prompt is not None else DEFAULT_PROMPT, timeout=timeout,
        load_path=load_path, rerun=(command_line_without("--timeout", "--json"), "--timeout"),
    )
    # on a terminal its phases as they come; on a pipe a line a phase and a heartbeat
    with step_log("smoke") or nullcontext() as log:
        on_phase = phase_progress(output_options().as_json) if log is None else log_phases(log)
        report = smoke_and_record(path, options, on_phase=on_phase)
    findings = list(report.findings)
    if problem is not None:
        findings.insert(0, warn(
            "smoke.load",
            f"{spelt!r}: {problem}; the smoke loads {load_path} instead",
            f"load the model by {load_path} (with or without a trailing slash)",
            paths=[path],
        ))
    finish(findings, directory=str(path), smoke=report.summary)


def _prompt(value: Optional[str]) -> Optional[str]:
    if value is not None and not value.strip():
        raise click.BadParameter("the prompt is empty: give some text (or leave --prompt out)")
    return value


def register(group: click.Group) -> None:
    group.add_command(smoke)
