"""`fix`: validate → choose sources → patch config → build → loader → modules cache →
state → smoke. Each step reads and extends one FixContext (steps/context.py)."""

from __future__ import annotations

import importlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from qwen_kvprep.common import JOURNAL_FILE, STATE_DIRNAME
from qwen_kvprep.errors import KvprepError
from qwen_kvprep.findings import Finding
from qwen_kvprep.journal import Journal, PlannedWrite
from qwen_kvprep.steps.context import FixContext, FixOptions

if TYPE_CHECKING:
    from qwen_kvprep.jsontypes import JSONObject
    from qwen_kvprep.probe.facts import Facts
    from qwen_kvprep.smoke.progress import StepLog

# What callers of `run_fix` use; the steps themselves import steps/context.py.
__all__ = ["FixOptions", "FixResult", "run_fix"]


@dataclass(frozen=True)
class FixResult:
    findings: list[Finding]
    planned: list[PlannedWrite]
    extra: JSONObject


# (module, condition): steps run in this order; a step raises a KvprepError to stop.
_STEPS: list[tuple[str, Callable[[FixOptions], bool]]] = [
    ("validate", lambda o: True),
    ("sources", lambda o: True),
    ("config_patch", lambda o: True),
    ("build", lambda o: True),  # reports --no-build itself (the loader then builds lazily)
    ("loader", lambda o: True),
    ("fastkv", lambda o: True),
    ("modules", lambda o: True),
    ("state", lambda o: True),
    # last: proves the result (a child process loads the model); dry-run has nothing to prove
    ("smoke", lambda o: o.smoke and not o.dry_run),
]

# What a log (stderr not a terminal) says as each step starts.
STEP_WORDS = {
    "validate": "checking the checkpoint",
    "sources": "choosing the kernel sources",
    "config_patch": "checking config.json",
    "build": "looking up the extension in the build cache",
    "loader": "installing the loader",
    "fastkv": "checking the fast path in modeling_qwen.py",
    "modules": "planting the files in the modules cache",
    "state": "recording the state",
    "smoke": "smoke test",
}


def run_fix(
    directory: Path,
    options: FixOptions,
    skip_if: Optional[Callable[[], bool]] = None,
    log: Optional[StepLog] = None,
) -> FixResult:
    """Run fix on DIR (or on a view of it in `options.output`).

    Every input is validated before the first write (the checkpoint, config.json, what an
    earlier run recorded), so a refused fix leaves the folder byte for byte as it was. The
    writes happen under the folder's lock (shared with prestart and revert); `skip_if`,
    called once the lock is held, may say the work is no longer needed (another replica
    did it). A run that fails before recording anything removes what it created (an empty
    `.qwen-kvprep/`, a new OUT); OS errors become messages that say what to do. `log`
    gets a line as each step starts (for a log that is not a terminal).
    """
    from qwen_kvprep.errors import os_failure

    source = Path(os.path.abspath(directory))
    target = source
    if options.output is not None:
        from qwen_kvprep.view import check_output_dir

        target = Path(os.path.abspath(options.output))
        check_output_dir(source, target)
    try:
        if log is not None:
            log.phase(STEP_WORDS["validate"])
        early = _preflight(source, target, options)
        early.log = log
        if options.dry_run:
            return _run_steps(source, target, options, early)
        return _run_locked(source, target, options, early, skip_if)
    except OSError as exc:
        raise os_failure(exc, target, output_option=options.output is None) from exc


@dataclass
class _Early:
    """What the read-only checks before the first write found."""

    facts: Optional[Facts] = None  # the validated checkpoint (DIR itself; None for a view)
    findings: list[Finding] = field(default_factory=list)
    log: Optional[StepLog] = None  # passed on to the steps


def _preflight(source: Path, target: Path, options: FixOptions) -> _Early:
    """Read-only checks of every input, before anything is written anywhere: the
    checkpoint and its config.json (CheckpointError/ConfigError), the journal of an
    earlier run (StateError). A damaged state.json is only noted: fix writes it anew."""
    from qwen_kvprep.findings import info
    from qwen_kvprep.state import state_problem
    from qwen_kvprep.steps import validate

    early = _Early()
    facts, findings = validate.check(source)
    if target == source:
        early.facts, early.findings = facts, findings
    if not os.path.isdir(target):
        return early
    Journal(target, dry_run=True)
    problem = state_problem(target)
    if problem is not None:
        early.findings.append(
            info(
                "state.record",
                f"{problem}: fix records the state anew",
                paths=[target / STATE_DIRNAME],
            )
        )
    return early


def _run_locked(
    source: Path,
    target: Path,
    options: FixOptions,
    early: _Early,
    skip_if: Optional[Callable[[], bool]],
) -> FixResult:
    from qwen_kvprep.buildcache.builder import stderr_notify
    from qwen_kvprep.buildcache.lock import lock_timeout
    from qwen_kvprep.dirlock import folder_lock

    new_top = None  # the outermost folder this run creates for --output
    if target != source:
        new_top = _first_missing(target)
        target.mkdir(parents=True, exist_ok=True)
    what = "qwen-kvprep command"
    # Only what this run created, and only while it holds the lock: a replica that made
    # OUT at the same moment may be preparing it (a waiter that gives up leaves it alone).
    with folder_lock(target, what, lock_timeout(), stderr_notify):
        if skip_if is not None and skip_if():
            return FixResult([], [], {})  # another replica prepared it meanwhile
        try:
            return _run_steps(source, target, options, early)
        except BaseException:
            _undo_creation(target, new_top)
            raise


def _undo_creation(target: Path, new_top: Optional[Path]) -> None:
    """After a failure: remove what this run created, unless something was recorded in
    it (a failed build leaves the patched config and its journal: revert undoes that)."""
    from qwen_kvprep.dirlock import release_if_unused

    if new_top is not None and not os.path.lexists(target / STATE_DIRNAME / JOURNAL_FILE):
        shutil.rmtree(new_top, ignore_errors=True)
    else:
        release_if_unused(target)


def _first_missing(path: Path) -> Optional[Path]:
    top = None
    for p in (path, *path.parents):
        if os.path.lexists(p):
            break
        top = p
    return top


def _run_steps(
    source: Path, target: Path, options: FixOptions, early: _Early
) -> FixResult:
    from qwen_kvprep.dirlock import OUR_FILES, remove_leftover_temps

    view_findings: list[Finding] = []
    directory = source
    if options.output is not None:
        from qwen_kvprep.view import fix_target

        directory, view_findings = fix_target(source, target, options.dry_run)
    if not options.dry_run:
        remove_leftover_temps(directory, set(OUR_FILES))
        remove_leftover_temps(directory / STATE_DIRNAME)
        remove_leftover_temps(directory / STATE_DIRNAME / "originals")
    ctx = FixContext(directory, options, Journal(directory, dry_run=options.dry_run))
    ctx.add(*early.findings, *view_findings)
    ctx.facts = early.facts
    ctx.log = early.log
    for name, wanted in _STEPS:
        if name == "validate" and early.facts is not None:
            continue  # done before the first write
        if wanted(options):
            if ctx.log is not None:
                ctx.log.phase(STEP_WORDS[name])
            try:
                importlib.import_module(f"qwen_kvprep.steps.{name}").run(ctx)
            except KvprepError as exc:
                # what the earlier steps found (a warning about replaced files, say)
                # belongs in the refusal too, before the reason itself
                seen = {id(f) for f in exc.findings}
                earlier = [f for f in ctx.findings if id(f) not in seen]
                exc.findings = (*earlier, *exc.findings)
                raise
    for path in ctx.journal.retaken:
        from qwen_kvprep.findings import info

        ctx.add(
            info(
                "checkpoint.changed",
                f"{path} changed since fix last wrote it (a new revision?): kept as the new "
                "original for revert",
                paths=[path],
            )
        )
    return FixResult(ctx.findings, ctx.journal.planned, ctx.extra)
