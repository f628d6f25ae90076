from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

import click

from qwen_kvprep.commands._common import (
    REVISION_HELP,
    checkpoint_dir,
    command_line_without,
    json_option,
    output_options,
)
from qwen_kvprep.commands._numbers import FiniteFloatRange
from qwen_kvprep.commands._options import NONEMPTY, quiet_option
from qwen_kvprep.convert.progress import ConvertLog
from qwen_kvprep.errors import UsageError
from qwen_kvprep.render import emit

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def _size(value: Optional[str]) -> Optional[int]:
    if value is None:
        return None
    text = value.strip().upper().replace(" ", "")
    number = text.rstrip("KMGIB")
    try:
        n = float(number) * _UNITS[text[len(number):]]
    except (KeyError, ValueError):
        raise UsageError(
            f"--max-shard-size {value}: a size such as 5GB, 500MB or 2GiB"
        ) from None
    if not math.isfinite(n):
        raise UsageError(f"--max-shard-size {value}: a finite size such as 5GB")
    if n < 1:
        raise UsageError(f"--max-shard-size {value}: a shard holds at least one byte (and "
                         "at least one tensor, whatever the size)")
    return int(n)


@click.command()
@click.argument("directory")
@click.argument("out", type=NONEMPTY)
@click.option("--max-shard-size", metavar="SIZE",
              help="Largest output shard, e.g. 5GB or 2GiB (default: one output shard per "
              "source weight file).")
@click.option("--context-factor", type=FiniteFloatRange(min=1.0, min_open=True), metavar="F",
              help="Declare seq_length * F positions, with --rope-scaling; OUT is then not "
              "exact past seq_length (default: exact, seq_length positions).")
@click.option("--rope-scaling", type=click.Choice(["yarn", "dynamic"]),
              help="The engines' rope scaling used with --context-factor.")
@click.option("--no-verify", is_flag=True,
              help="Skip loading the original and OUT in a child process to compare their "
              "logits (the bit-for-bit tensor comparison still runs).")
@click.option("--verify-timeout", type=FiniteFloatRange(min=1.0), default=1800.0,
              show_default=True, metavar="S", help="Seconds the verification child may take.")
@click.option("--kv-cache", type=click.Choice(["fp8"]),
              help="Also write calibrated fp8 KV cache scales (per layer, measured on OUT; "
              "vLLM and SGLang load them). On a folder already converted, adds them in place.")
@click.option("--calibration", metavar="FILE",
              help="With --kv-cache: the text to calibrate on (UTF-8, or JSONL with a \"text\" "
              "field; at least 512 tokens). Default: a built-in multilingual text, 1,024 tokens.")
@click.option("--revision", metavar="REV", help=REVISION_HELP)
@json_option
@quiet_option
def convert(
    directory: str,
    out: str,
    max_shard_size: Optional[str],
    context_factor: Optional[float],
    rope_scaling: Optional[str],
    no_verify: bool,
    verify_timeout: float,
    kv_cache: Optional[str],
    calibration: Optional[str],
    revision: Optional[str],
    quiet: bool,
) -> None:
    """Write the Qwen (v1) checkpoint DIRECTORY as a native Qwen2ForCausalLM checkpoint in
    OUT (a new or empty folder outside DIRECTORY), proven equal tensor for tensor.

    DIRECTORY is never written. OUT appears only when complete; a killed run is finished by
    running the same command again. DIRECTORY may be a Hub repo id (ORG/NAME) found in the
    local Hub cache."""
    # here, not at the top: torch and safetensors cost every start of the CLI, --help included
    from qwen_kvprep.convert import run

    as_json = output_options().as_json
    path, _ = checkpoint_dir(directory, revision, quiet=quiet)
    options = run.ConvertOptions(
        max_shard_size=_size(max_shard_size), context_factor=context_factor,
        rope_scaling=rope_scaling, verify=not no_verify, verify_timeout=verify_timeout,
        spelt=directory,  # as given: a repo id stays one
        command=command_line_without("--json"),
        kv_cache=kv_cache, calibration=Path(calibration) if calibration is not None else None,
    )

    # stderr, with --json too: stdout holds the result alone
    log = None if quiet else ConvertLog(sys.stderr, tty=sys.stderr.isatty())
    try:
        result = run.convert(path, Path(out), options, log=log)
    finally:
        if log is not None:
            log.close()
    if as_json:
        doc = {"ok": True, **result.to_json(),
               "findings": [f.to_json() for f in result.findings]}
        emit(json.dumps(doc, indent=2, default=str))
    else:
        emit("\n".join(run.summary(result)))


def register(group: click.Group) -> None:
    group.add_command(convert)
