"""A folder `convert` wrote, given where a Qwen (v1) checkpoint is expected.

It is a native Qwen2 checkpoint: transformers' own code and the serving engines load it,
with no kernels, no config flags and no remote code. fix and convert refuse it before any
write (`refusal`), and prestart starts the server on it as it is (`prestart_line`).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

from qwen_kvprep.convert.serving import commands, vllm_launch
from qwen_kvprep.errors import CheckpointError, KvprepError
from qwen_kvprep.provenance import Provenance, read


def _record(directory: Path) -> tuple[Optional[Provenance], str]:
    """OUT's provenance (None when it cannot be trusted) and the source named as words."""
    try:
        rec = read(directory)
    except (KvprepError, OSError):
        return None, "a Qwen (v1) checkpoint (its provenance.json cannot be read)"
    return rec, rec.source_path


def _serve_line(directory: Path, rec: Optional[Provenance]) -> str:
    """The first of convert's serving lines (vLLM: fp8 with OUT's calibrated KV scales,
    else the unquantized cache), at the length OUT is meant for."""
    length = (rec.exact_up_to or 0) if rec is not None else 0  # None: yarn, exact nowhere
    context = rec.extra.get("context") if rec is not None else None
    if isinstance(context, dict):
        serving = context.get("serving_length")
        if isinstance(serving, int) and not isinstance(serving, bool) and serving > 0:
            length = serving
    gptq = rec is not None and "quantize_config.json" in rec.outputs
    if length < 1:
        return vllm_launch(shlex.quote(str(directory)))
    return commands(directory, gptq=gptq, max_len=length)[0][1]


def refusal(directory: Path) -> CheckpointError:
    """What fix and convert say, before any write, when DIR is a folder convert wrote."""
    rec, source = _record(directory)
    here = shlex.quote(str(directory))
    return CheckpointError(
        f"{directory} is a Qwen2 checkpoint that `qwen-kvprep convert` wrote from {source}: "
        "it is already converted. It runs natively on transformers' own Qwen2 code and the "
        "serving engines (no kernels, no config flags, no remote code), so neither fix nor "
        "convert has anything to do here (nothing was written)",
        fix=f"serve it as it is, e.g. `{_serve_line(directory, rec)}` (convert printed the "
        f"other engines' lines); `qwen-kvprep doctor {here}` says whether it still matches "
        "its source",
    )


def prestart_line(directory: Path, output: Optional[str]) -> str:
    """prestart's one line on stderr when DIR is a folder convert wrote. With --output,
    OUT is not made either (a view of a native checkpoint would only be links to it): the
    server is to be pointed at DIR."""
    _rec, source = _record(directory)
    instead = f" ({output} was not made: serve {directory} itself)" if output else ""
    return (
        f"{directory} is a Qwen2 checkpoint that qwen-kvprep convert wrote from {source}: "
        "it runs natively (no kernels, no config flags, no remote code), so nothing was "
        f"prepared{instead}; starting the command"
    )
