"""prestart's slow path: the recorded state does not hold, so run fix for what is missing.

fix validates every input first, then takes the folder's lock (the one fix and revert
take), so replicas starting together on one directory do the work once: the others wait,
then find the state matching and skip it. With --allow-fallback a failure does not stop
CMD: the failure is returned (the command reports it) and, for --output, OUT is made a
plain view of DIR so that CMD has a model to serve.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from qwen_kvprep.checks.identity import identify
from qwen_kvprep.errors import KvprepError, UsageError
from qwen_kvprep.findings import Finding, failed, info
from qwen_kvprep.probe.checkpoint import probe_checkpoint
from qwen_kvprep.provenance import PROVENANCE
from qwen_kvprep.quickstart import Planting, Request, say, state_mismatch
from qwen_kvprep.steps.converted import prestart_line
from qwen_kvprep.steps.fix import FixOptions, run_fix
from qwen_kvprep.steps.prebuilt import configured
from qwen_kvprep.view import prepare_view, read_marker


@dataclass
class Prepared:
    """What the slow path did, for the command to report before it hands over to CMD."""

    findings: list[Finding] = field(default_factory=list)  # fix's
    # The failure --allow-fallback let through (CMD then starts without the kernel).
    failure: Optional[Exception] = None
    # Why OUT could not be made a plain view of DIR after that failure.
    view_error: Optional[Exception] = None
    # Why the state still does not hold after preparing (the next start checks again).
    recheck: Optional[str] = None
    # DIR is a native Qwen2 checkpoint convert wrote: nothing was prepared, and why.
    native: Optional[str] = None


def prepare(request: Request, planting: Planting) -> list[Finding]:
    """Do what the state says is missing, by running fix (idempotent steps: what is
    already right costs a hash). Returns fix's findings; raises KvprepError on failure."""
    assert request.directory is not None
    directory = Path(os.path.abspath(request.directory))
    options = FixOptions(
        prebuilt=prebuilt_in_force(request.target),
        smoke=request.smoke,
        source=request.source or "auto",
        cache_dir=Path(request.cache_dir) if request.cache_dir else None,
        arch=request.arch,
        output=Path(os.path.abspath(request.output)) if request.output else None,
    )
    # Another replica may have finished while we waited for the lock.
    result = run_fix(
        directory, options, skip_if=lambda: state_mismatch(request, planting) is None
    )
    if failed(result.findings):
        bad = [f for f in result.findings if f.severity.value == "fail"]
        raise KvprepError(
            f"fix reported {len(bad)} failure(s) while preparing {request.target}",
            fix=bad[0].fix,
            findings=result.findings,
        )
    return list(result.findings)


def prebuilt_in_force(target: str) -> Optional[str]:
    """$QWEN_KVPREP_PREBUILT, else the SOURCE a checkpoint fixed with --prebuilt was prepared
    from (so a fresh build cache gets the variant again, not a compile), else None."""
    try:
        return configured(Path(target))[0]
    except (KvprepError, OSError):
        return None


def plain_view_for_fallback(request: Request) -> Optional[Exception]:
    """--allow-fallback with --output: CMD serves from OUT, so OUT must exist even when
    preparing was refused (a refused fix creates nothing). Make it a plain view of DIR
    (links only, nothing patched): the model runs, without the kernel. Returns why that
    failed (CMD still starts, and reports its own problem), or None."""
    if not request.output or request.directory is None:
        return None

    out = request.target
    if read_marker(out) is not None:
        return None
    try:
        prepare_view(Path(os.path.abspath(request.directory)), Path(out))
    except Exception as exc:  # availability first
        return exc
    return None


def _native(request: Request) -> Optional[str]:
    """prestart's line when DIR is a folder convert wrote (None otherwise): it needs no
    preparing, and fix would refuse it, so a container whose entrypoint still runs prestart
    keeps serving when it switches to the converted folder."""
    assert request.directory is not None
    directory = Path(os.path.abspath(request.directory))
    if not os.path.lexists(directory / PROVENANCE):
        return None  # the usual case, told without probing the checkpoint twice
    try:
        converted = identify(probe_checkpoint(directory)).converted
    except (KvprepError, OSError):
        return None  # fix's validation says what is wrong with the folder
    return prestart_line(directory, request.output) if converted else None


def prepare_or_fall_back(request: Request, planting: Planting, reason: str) -> Prepared:
    """Run fix for what is missing (`reason`, said first). A failure raises, unless
    --allow-fallback lets it through (a usage error never is: a wrong invocation is not
    papered over). A folder convert wrote is left as it is (`Prepared.native`)."""
    native = _native(request)
    if native is not None:
        return Prepared(findings=[info("checkpoint.identity", native)], native=native)
    say(request, f"preparing: {reason}")
    try:
        findings = prepare(request, planting)
    except UsageError:
        raise
    except Exception as exc:
        # --allow-fallback is for availability: any failure, even one we did not foresee,
        # must not keep the server down (it runs without the kernel, and says so).
        if not request.allow_fallback:
            raise
        return Prepared(failure=exc, view_error=plain_view_for_fallback(request))
    return Prepared(findings=findings, recheck=state_mismatch(request, planting))
