"""Parent side of `profile`: one child per (batch, mode), plus a probe first and the
quality run last; the rows of the plan contract out of what they said.

Runs are ordered by batch, both modes at each, so a cut-short profile still compares the
modes. After a mode runs out of memory its larger batches are not tried (they would only
take longer to fail) and are marked out of memory with the reason; after any other
failure the rest of that mode is skipped, since a mode that cannot load at one batch
cannot at the next.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, TypedDict, cast

from qwen_kvprep.childproc import ChildOutcome, child_env, run_events_child
from qwen_kvprep.errors import KvprepError
from qwen_kvprep.profile.progress import Progress
from qwen_kvprep.profile.protocol import (
    CPU_BATCHES,
    CPU_NEW_TOKENS,
    DEFAULT_PROMPT_TOKENS,
    DEFAULT_TIMEOUT_S,
    GPU_BATCHES,
    GPU_NEW_TOKENS,
    MODES,
    PHASE_WORDS,
    RANDOM_SEED,
    TASK_PROBE,
    TASK_QUALITY,
    TASK_RUN,
    ChildSpec,
    DeviceInfo,
    ProbeResult,
    ProfileResult,
    QualityResult,
    Versions,
)
from qwen_kvprep.profile.source import ModelSource

# The probe only imports torch and asks for the device.
_PROBE_TIMEOUT_S = 300.0

ROW_FIELDS = (
    "mode",
    "batch",
    "prompt_tokens",
    "new_tokens",
    "cached_tokens",
    "kv_bytes",
    "peak_bytes",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "kernel_layers",
    "fast_layers",
    "oom",
    "predicted_bytes",
    "error",
    "seconds",
)


class ProfileRow(TypedDict):
    """One run of the plan contract (ROW_FIELDS, in that order): a row of --json."""

    mode: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    cached_tokens: Optional[int]
    kv_bytes: Optional[int]
    peak_bytes: Optional[int]
    prefill_tokens_per_s: Optional[float]
    decode_tokens_per_s: Optional[float]
    kernel_layers: Optional[int]
    fast_layers: Optional[int]  # layers that ran qwen-kvprep's fast path (int8 runs)
    oom: bool
    predicted_bytes: Optional[int]  # plan's prediction, filled in afterwards
    error: Optional[str]
    seconds: float


ProfileOutcome = ChildOutcome[ProfileResult]


class ProfileError(KvprepError):
    """The profile could not start (no usable torch or device)."""


@dataclass(frozen=True)
class ProfileOptions:
    device: str = "auto"
    batches: Optional[tuple[int, ...]] = None  # None: the device's default list
    new_tokens: Optional[int] = None  # None: the device's default
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    prefill_chunk: Optional[int] = None
    random_weights: bool = False
    dtype: Optional[str] = None
    quality: bool = False
    quality_text: Optional[Path] = None  # None with quality: the built-in passage
    timeout: float = DEFAULT_TIMEOUT_S
    cudnn_attention: bool = True  # False: torch's cuDNN SDPA backend off in every child
    fast_path: bool = True  # False: the Int8 runs use the model's own code (ChildSpec)


@dataclass
class RunRecord:
    """One child's outcome beside the row made from it (the findings need both)."""

    spec: ChildSpec
    outcome: Optional[ProfileOutcome]  # None: skipped
    row: ProfileRow


@dataclass
class QualityRecord:
    """The quality child's outcome beside its answer."""

    spec: ChildSpec
    outcome: ProfileOutcome
    quality: Optional[QualityResult]  # None: the child gave none


@dataclass
class Measurements:
    device: DeviceInfo
    versions: Versions
    batches: tuple[int, ...]
    new_tokens: int
    runs: list[RunRecord] = field(default_factory=list)
    quality: Optional[QualityRecord] = None
    dtype: Optional[str] = None  # as the runs loaded the model


def _command(spec: ChildSpec, fd: int) -> list[str]:
    return [sys.executable, "-m", "qwen_kvprep.profile.child", "--fd", str(fd),
            "--spec", spec.to_json()]


def run_child(
    spec: ChildSpec, source: ModelSource, timeout: float, bar: Optional[Progress], label: str
) -> ProfileOutcome:
    if bar is not None:
        bar.start(label)
    outcome = run_events_child(
        lambda fd: _command(spec, fd),
        timeout,
        bar.event if bar is not None else None,
        env=child_env(source.child_env),
        prefix="qwen-kvprep-profile-child-",
    )
    if bar is not None:
        bar.finish_step()
    # the child is qwen_kvprep.profile.child of this very installation (child_env puts it
    # first on the path): its result is one of the answers in profile.protocol
    return cast(ProfileOutcome, outcome)


def failure_text(outcome: ProfileOutcome, timeout: float) -> str:
    """One line: why a child gave no result."""
    doing = PHASE_WORDS.get(outcome.phase, outcome.phase)
    if outcome.timed_out:
        return f"timed out after {timeout:g} s while {doing}"
    if outcome.error is not None:
        message = str(outcome.error.get("message") or "").strip().splitlines()
        return f"{outcome.error.get('type')} while {doing}: {message[0] if message else ''}"
    code = outcome.returncode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} while {doing}"
    return f"exited with status {code} while {doing}, without a result"


def killed_for_memory(outcome: ProfileOutcome) -> bool:
    """SIGKILL from nobody we know of: on Linux, the kernel's out-of-memory killer."""
    return (
        not outcome.timed_out
        and outcome.result is None
        and outcome.returncode == -signal.SIGKILL
    )


def _row(
    spec: ChildSpec, seconds: float, oom: bool = False, error: Optional[str] = None
) -> ProfileRow:
    """The row of a run that measured nothing."""
    return {
        "mode": spec.mode,
        "batch": spec.batch,
        "prompt_tokens": spec.prompt_tokens,
        "new_tokens": spec.new_tokens,
        "cached_tokens": None,
        "kv_bytes": None,
        "peak_bytes": None,
        "prefill_tokens_per_s": None,
        "decode_tokens_per_s": None,
        "kernel_layers": None,
        "fast_layers": None,
        "oom": oom,
        "predicted_bytes": None,
        "error": error,
        "seconds": seconds,
    }


def make_row(spec: ChildSpec, outcome: ProfileOutcome, timeout: float) -> ProfileRow:
    seconds = round(outcome.elapsed, 2)
    result = outcome.result
    if result is None:
        error = failure_text(outcome, timeout)
        oom = killed_for_memory(outcome)
        if oom:
            error += " (on Linux usually the kernel's out-of-memory killer)"
        return _row(spec, seconds, oom=oom, error=error)
    return {
        **_row(spec, seconds),
        "cached_tokens": result.get("cached_tokens"),
        "kv_bytes": result.get("kv_bytes"),
        "peak_bytes": result.get("peak_bytes"),
        "prefill_tokens_per_s": result.get("prefill_tokens_per_s"),
        "decode_tokens_per_s": result.get("decode_tokens_per_s"),
        "kernel_layers": result.get("kernel_layers") if spec.mode == "int8" else 0,
        "fast_layers": result.get("fast_layers") if spec.mode == "int8" else 0,
        "oom": bool(result.get("oom")),
        "error": result.get("error"),
    }


def skipped_row(spec: ChildSpec, reason: str, oom: bool) -> ProfileRow:
    return _row(spec, 0.0, oom=oom, error=reason)


def probe(
    source: ModelSource, options: ProfileOptions, bar: Optional[Progress]
) -> ProbeResult:
    spec = ChildSpec(task=TASK_PROBE, source=str(source.load_from), device=options.device,
                     cudnn_attention=options.cudnn_attention)
    outcome = run_child(spec, source, min(options.timeout, _PROBE_TIMEOUT_S), bar,
                        "checking torch and the device")
    if outcome.result is None:
        why = failure_text(outcome, _PROBE_TIMEOUT_S)
        message = f"cannot start: {why}"
        fix = (
            "install a CUDA build of torch, or use --device cpu"
            if options.device == "cuda"
            else "check the torch installation: python -c 'import torch'"
        )
        raise ProfileError.failing("profile.device", message, fix, log_tail=outcome.log_tail)
    return outcome.result


def measure(
    source: ModelSource, options: ProfileOptions, bar: Optional[Progress] = None
) -> Measurements:
    info = probe(source, options, bar)
    device = info["device"]
    on_gpu = device.get("kind") == "cuda"
    batches = tuple(sorted(set(options.batches or (GPU_BATCHES if on_gpu else CPU_BATCHES))))
    new_tokens = options.new_tokens or (GPU_NEW_TOKENS if on_gpu else CPU_NEW_TOKENS)
    found = Measurements(device=device, versions=info["versions"], batches=batches,
                         new_tokens=new_tokens)
    if bar is not None:
        bar.total = 1 + 2 * len(batches) + int(options.quality)
    base = ChildSpec(
        task=TASK_RUN,
        source=str(source.load_from),
        device=device["kind"],  # what the probe resolved "auto" to, for every run alike
        prompt_tokens=options.prompt_tokens,
        new_tokens=new_tokens,
        prefill_chunk=options.prefill_chunk,
        dtype=options.dtype,
        random_weights=source.random_weights,
        plant_kernels=source.plant_kernels,
        seed=RANDOM_SEED,
        cudnn_attention=options.cudnn_attention,
        fast_path=options.fast_path,
    )
    stopped: dict[str, tuple[str, bool]] = {}  # mode -> (reason, oom)
    for batch in batches:
        for mode in MODES:
            spec = replace(base, mode=mode, batch=batch)
            if mode in stopped:
                reason, oom = stopped[mode]
                found.runs.append(RunRecord(spec, None, skipped_row(spec, reason, oom)))
                if bar is not None:
                    bar.finish_step()
                continue
            outcome = run_child(spec, source, options.timeout, bar, f"{mode} batch {batch}")
            row = make_row(spec, outcome, options.timeout)
            found.runs.append(RunRecord(spec, outcome, row))
            if outcome.result is not None and outcome.result.get("dtype"):
                found.dtype = found.dtype or str(outcome.result["dtype"])
            if row["oom"]:
                stopped[mode] = (f"skipped: batch {batch} already ran out of memory", True)
            elif row["error"]:
                stopped[mode] = (f"skipped: the run at batch {batch} failed", False)
    if options.quality:
        spec = replace(base, task=TASK_QUALITY, mode="int8", batch=1,
                       text_file=str(options.quality_text) if options.quality_text else None)
        outcome = run_child(spec, source, options.timeout, bar, "quality")
        quality = outcome.result.get("quality") if outcome.result is not None else None
        found.quality = QualityRecord(spec, outcome, quality or None)
        if outcome.result is not None and outcome.result.get("dtype"):
            found.dtype = found.dtype or str(outcome.result["dtype"])
    return found
