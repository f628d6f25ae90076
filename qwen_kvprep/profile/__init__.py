"""`profile`: measure what the Int8 KV cache saves on the user's own model and device.

For each batch size and each mode (unquantized, int8) one child process loads the model,
prefills a prompt and decodes N tokens (the procedure `plan` predicts), and reports the
cache bytes, the memory peak, the speed and how many layers ran the compiled kernel.
`--quality` adds a teacher-forced comparison of the two modes over a text.

Parent side: source.py (what to load), runner.py (the children, the rows), predict.py
(plan's figures beside them), evaluate.py (findings), render.py and plot.py (output).
Child side: child.py and quality.py. Light imports only: the CLI imports this package
without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep.errors import UsageError
from qwen_kvprep.findings import Finding, info
from qwen_kvprep.profile.document import ProfileDocument, peak_measure
from qwen_kvprep.profile.progress import Progress
from qwen_kvprep.profile.protocol import RANDOM_SEED
from qwen_kvprep.profile.runner import (
    Measurements,
    ProfileError,
    ProfileOptions,
    ProfileRow,
    measure,
)
from qwen_kvprep.profile.source import model_source

__all__ = [
    "BUILTIN_PASSAGE",
    "ProfileError",
    "ProfileOptions",
    "ProfileReport",
    "parse_batches",
    "profile_and_plot",
    "quality_file",
    "run_profile",
]


# The options profile takes, as the command line spells them.
BUILTIN_PASSAGE = "\0builtin"  # --quality without a file


def parse_batches(value: Optional[str]) -> Optional[tuple[int, ...]]:
    """`--batch 1,4,16`, read exactly as plan reads its --batch; None: the device's
    default batches."""
    if value is None:
        return None
    # here, not at the top: planning/ costs every start of the CLI ~25 ms (run_profile
    # loads it anyway, for plan's prediction)
    from qwen_kvprep.planning.sizes import parse_int_list

    return parse_int_list(value, "--batch")


def quality_file(value: Optional[str]) -> Optional[Path]:
    """The text of `--quality TEXTFILE`; None for the built-in passage or no --quality."""
    if value in (None, BUILTIN_PASSAGE):
        return None
    path = Path(str(value)).absolute()
    if not path.is_file():
        raise UsageError(f"--quality {value}: no such file")
    return path


@dataclass(frozen=True)
class ProfileReport:
    findings: list[Finding]
    profile: ProfileDocument  # the "profile" object of --json
    measurements: Measurements


def max_batch(rows: list[ProfileRow]) -> dict[str, Optional[int]]:
    """Per mode, the largest batch that ran to the end (no OOM, no error)."""
    out: dict[str, Optional[int]] = {}
    for mode in ("unquantized", "int8"):
        fit = [r["batch"] for r in rows if r["mode"] == mode and not r["oom"] and not r["error"]]
        out[mode] = max(fit) if fit else None
    return out


def run_profile(
    directory: Path, options: ProfileOptions, bar: Optional[Progress] = None
) -> ProfileReport:
    """Measure; never raises for what a child does (crashes, hangs and OOMs come back in
    the rows and findings). Raises KvprepError subclasses when it cannot start: a folder
    without weights (and no --random-weights), an unreadable config.json, no torch."""
    # here: the CLI imports this package for profile/protocol.py at every start, and the
    # evaluation and plan's prediction (plan.py, planning/) would add to each start
    from qwen_kvprep.profile.evaluate import evaluate
    from qwen_kvprep.profile.predict import fill_predictions, per_token, shape_of

    with model_source(directory, options.random_weights) as source:
        found = measure(source, options, bar)
    rows = [r.row for r in found.runs]
    shape, plan_problem = shape_of(source.directory, found.dtype or options.dtype)
    fill_predictions(rows, shape, options.prefill_chunk)
    units = per_token(shape)
    layers = next((r.outcome.result.get("layers") for r in found.runs
                   if r.outcome is not None and r.outcome.result is not None
                   and r.outcome.result.get("layers") is not None), None)
    findings = evaluate(found, source, units, layers, options.timeout, plan_problem)
    profile: ProfileDocument = {
        "directory": str(source.directory),
        "source": source.to_json(),
        "device": found.device,
        "versions": found.versions,
        "batches": list(found.batches),
        "prompt_tokens": options.prompt_tokens,
        "new_tokens": found.new_tokens,
        "prefill_chunk": options.prefill_chunk,
        "dtype": found.dtype or options.dtype,
        "random_weights": options.random_weights,
        "seed": RANDOM_SEED if options.random_weights else None,
        "timeout": options.timeout,
        "use_flash_attn": False,
        "model": {
            "layers": layers,
            "heads": shape.heads if shape else None,
            "head_dim": shape.head_dim if shape else None,
            "weights_bytes": shape.weights_bytes if shape else None,
            "gptq_bits": shape.gptq_bits if shape else None,
            "kv_bytes_per_token": units,
        },
        "peak_measure": peak_measure(found.device.get("kind")),
        "rows": rows,
        "max_batch": max_batch(rows),
        "quality": found.quality.quality if found.quality is not None else None,
    }
    return ProfileReport(findings, profile, found)


def profile_and_plot(
    directory: Path,
    options: ProfileOptions,
    bar: Optional[Progress] = None,
    plot: Optional[Path] = None,
) -> ProfileReport:
    """`qwen-kvprep profile`: run_profile, then the plot drawn into `plot` when asked."""
    report = run_profile(directory, options, bar)
    if plot is None:
        return report
    from qwen_kvprep.profile.plot import write_plot

    written = write_plot(report.profile, plot)
    drawn = info("profile.plot", f"wrote the plot to {written}", paths=[written])
    return ProfileReport([*report.findings, drawn], report.profile, report.measurements)
