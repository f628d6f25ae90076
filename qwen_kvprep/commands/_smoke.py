"""What smoke's command needs beside its options: the device check, and the engine smoke
of a folder convert wrote (`smoke OUT --engine ...`; the library is
qwen_kvprep.engines.runner), which smoke.py hands over to."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import NoReturn, Optional

from qwen_kvprep.commands._common import finish, output_options
from qwen_kvprep.engines.installs import vllm_command_problem
from qwen_kvprep.engines.runner import EngineSmokeOptions
from qwen_kvprep.engines.runner import engine_smoke as run
from qwen_kvprep.errors import UsageError
from qwen_kvprep.findings import info
from qwen_kvprep.render import emit
from qwen_kvprep.smoke.progress import log_phases, phase_progress, step_log


def engine_smoke(
    path: Path, engine: str, new_tokens: int, timeout: float, *, prompt: Optional[str],
    device: str,
) -> NoReturn:
    if prompt is not None or device == "cuda":
        raise UsageError(
            f"{'--prompt' if prompt is not None else '--device cuda'} is for the Int8 cache's "
            f"smoke of a Qwen (v1) folder; the engine smoke of {path} reads convert's proof "
            "prompts, on the engine's own device",
            fix=f"qwen-kvprep smoke {path} --engine {engine} (without that option)",
        )
    options = EngineSmokeOptions(engine=engine, new_tokens=new_tokens, timeout=timeout)
    with step_log("smoke") or nullcontext() as log:
        on_phase = phase_progress(output_options().as_json) if log is None else log_phases(log)
        report = run(path, options, on_phase=on_phase)
    findings = list(report.findings)
    problem = vllm_command_problem() if engine == "vllm" else None
    if problem is not None:
        findings.append(info("engine.command", problem[0], problem[1]))
    if not output_options().as_json:
        emit("\n".join(report.lines) + "\n")
    finish(findings, False, directory=str(path), **report.to_json())


def device_available(device: str) -> None:
    if device != "cuda":
        return
    import torch  # only for this answer: the model is loaded in the child

    if not torch.cuda.is_available():
        raise UsageError(
            f"--device cuda, but torch {torch.__version__} sees no GPU here "
            f"(torch.version.cuda={torch.version.cuda})",
            fix="use --device cpu, or --device auto (the GPU when torch sees one)",
        )
