"""`fix`: validate → choose sources → patch config → build → loader → modules cache →
state → smoke. Each step reads and extends one FixContext (steps/context.py)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from qwen_kvprep.buildcache import resolve_cache_dir
from qwen_kvprep.buildcache.builder import stderr_notify
from qwen_kvprep.buildcache.lock import lock_timeout
from qwen_kvprep.buildcache.marker import identify
from qwen_kvprep.common import JOURNAL_FILE, MODELING_FILE, STATE_DIRNAME, STATE_FILE
from qwen_kvprep.dirlock import OUR_FILES, folder_lock, release_if_unused, remove_leftover_temps
from qwen_kvprep.errors import KvprepError, StateError, os_failure
from qwen_kvprep.findings import Finding, info, warn
from qwen_kvprep.journal.writer import Journal, PlannedWrite
from qwen_kvprep.modcache import refuse_links_before_fix
from qwen_kvprep.state.writer import state_problem
from qwen_kvprep.steps import (
    build,
    config_patch,
    fastkv,
    loader,
    modules,
    record,
    smoke,
    sources,
    validate,
)
from qwen_kvprep.steps.context import FixContext, FixExtra, FixOptions
from qwen_kvprep.view import check_output_dir, fix_target

if TYPE_CHECKING:
    from qwen_kvprep.probe.facts import Facts
    from qwen_kvprep.smoke.evaluate import SmokeSummary
    from qwen_kvprep.smoke.progress import StepLog

# What callers of `run_fix` use; the steps themselves import steps/context.py.
__all__ = ["FixExtra", "FixOptions", "FixResult", "run_fix"]


@dataclass(frozen=True)
class FixResult:
    findings: list[Finding]
    planned: list[PlannedWrite]
    extra: FixExtra
    smoke: Optional[SmokeSummary] = None  # the smoke this run ran (not one recorded earlier)


# (step, what a log says as it starts, condition): steps run in this order; a step raises
# a KvprepError to stop. No step imports this module, so the table holds the functions.
_Step = Callable[[FixContext], None]
_STEPS: list[tuple[_Step, str, Optional[Callable[[FixOptions], bool]]]] = [
    # done before the first write when DIR itself is fixed
    (validate.run, "checking the checkpoint", None),
    (sources.run, "choosing the kernel sources", None),
    (config_patch.run, "checking config.json", None),
    # reports --no-build itself (the loader then builds lazily)
    (build.run, "looking up the extension in the build cache", None),
    (loader.run, "installing the loader", None),
    (fastkv.run, "checking the fast path in modeling_qwen.py", None),
    (modules.run, "planting the files in the modules cache", None),
    (record.run, "recording the state", None),
    # last: proves the result (a child process loads the model); dry-run has nothing to prove
    (smoke.run, "smoke test", lambda o: o.smoke and not o.dry_run),
]


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
    source = Path(os.path.abspath(directory))
    target = source
    if options.output is not None:
        target = Path(os.path.abspath(options.output))
        check_output_dir(source, target)
    try:
        if log is not None:
            log.phase(_STEPS[0][1])
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
    early = _Early()
    # the model code fix would edit: DIR's, or the one an earlier fix wrote in OUT. First:
    # code that is not UTF-8 would otherwise be judged (its imports, what it needs) as text
    # transformers cannot even read
    fastkv.check_markers(target if os.path.isfile(target / MODELING_FILE) else source)
    facts, findings = validate.check(source)
    _check_cache_folder(options)
    if target == source:
        early.facts, early.findings = facts, findings
    if not os.path.isdir(target):
        return early
    # a folder fix will plant into, reached through a link: refused before DIR is touched
    refuse_links_before_fix(target)
    early.findings.extend(_revert_problems(Journal(target, dry_run=True), target))
    _check_state_file(target)
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


def _revert_problems(journal: Journal, target: Path) -> list[Finding]:
    """What an earlier fix's journal can no longer undo (an original deleted or changed in
    the state folder): fix goes on, but says that revert would refuse, and why."""
    if not journal.exists:
        return []
    advice = (
        "put the original back from a backup; until then `qwen-kvprep revert` changes "
        f"nothing (`qwen-kvprep doctor {shlex.quote(str(target))}` says how to restore by hand)"
    )
    return [
        warn("state.journal", f"`qwen-kvprep revert` would refuse: {problem}", advice,
             paths=[target / STATE_DIRNAME])
        for problem in journal.plan_revert().problems
    ]


def _check_state_file(target: Path) -> None:
    """A damaged state.json is written anew at the end; a folder in its place cannot be
    replaced, and every run would fail there after writing everything else."""
    path = target / STATE_DIRNAME / STATE_FILE
    if os.path.isdir(path) and not os.path.islink(path):
        raise StateError.failing(
            "state.record",
            f"{path} is a folder, where fix records its state in a file",
            f"remove it (`rm -r {shlex.quote(str(path))}`) and run fix again",
            [path],
        )


def _check_cache_folder(options: FixOptions) -> None:
    """A build cache path that names a file ($QWEN_KVPREP_CACHE=/etc/hostname), or a folder
    that is not a build cache (a typo naming someone's folder, a cache folder linked
    elsewhere), fails every build and every load: say so before the first write, not after
    the config and the loader were changed (buildcache/marker.py). (An unwritable folder
    may still hold the build: the build step judges that.)"""
    identify(resolve_cache_dir(options.cache_dir))


def _run_locked(
    source: Path,
    target: Path,
    options: FixOptions,
    early: _Early,
    skip_if: Optional[Callable[[], bool]],
) -> FixResult:
    new_top = None  # the outermost folder this run creates for --output
    if target != source:
        new_top = _first_missing(target)
        target.mkdir(parents=True, exist_ok=True)
    what = "qwen-kvprep command"
    # Only what this run created, and only while it holds the lock: a replica that made
    # OUT at the same moment may be preparing it (a waiter that gives up leaves it alone).
    with folder_lock(target, what, lock_timeout(), stderr_notify):
        if skip_if is not None and skip_if():
            return FixResult([], [], FixExtra())  # another replica prepared it meanwhile
        had_journal = os.path.lexists(target / STATE_DIRNAME / JOURNAL_FILE)
        try:
            return _run_steps(source, target, options, early)
        except BaseException:
            if not had_journal:
                _drop_journal_of_nothing(target)
            _undo_creation(target, new_top)
            raise


def _drop_journal_of_nothing(target: Path) -> None:
    """After a failure, the journal this run began when it recorded only what it was
    about to do (a full disk refused its first write): every file it names is still the
    original and nothing was planted. Left there, it would read as a revert cut short
    once it had restored everything (doctor's state.record); there is nothing to revert."""
    try:
        journal = Journal(target, dry_run=True)
        unchanged = journal.exists and not journal.planted_files and journal.plan_revert().undone
    except (KvprepError, OSError):
        return
    if unchanged:
        with contextlib.suppress(OSError):
            os.unlink(target / STATE_DIRNAME / JOURNAL_FILE)
        shutil.rmtree(target / STATE_DIRNAME / "originals", ignore_errors=True)


def _undo_creation(target: Path, new_top: Optional[Path]) -> None:
    """After a failure: remove what this run created, unless something was recorded in
    it (a failed build leaves the patched config and its journal: revert undoes that)."""
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
    view_findings: list[Finding] = []
    directory = source
    if options.output is not None:
        directory, view_findings = fix_target(source, target, options.dry_run)
    if not options.dry_run:
        remove_leftover_temps(directory, set(OUR_FILES))
        remove_leftover_temps(directory / STATE_DIRNAME)
        remove_leftover_temps(directory / STATE_DIRNAME / "originals")
    ctx = FixContext(directory, options, Journal(directory, dry_run=options.dry_run))
    ctx.add(*early.findings, *view_findings)
    ctx.facts = early.facts
    ctx.log = early.log
    for step, words, wanted in _STEPS:
        if step is validate.run and early.facts is not None:
            continue  # done before the first write
        if wanted is None or wanted(options):
            if ctx.log is not None:
                ctx.log.phase(words)
            try:
                step(ctx)
            except KvprepError as exc:
                # what the earlier steps found (a warning about replaced files, say)
                # belongs in the refusal too, before the reason itself
                seen = {id(f) for f in exc.findings}
                earlier = [f for f in ctx.findings if id(f) not in seen]
                exc.findings = (*earlier, *exc.findings)
                raise
    for path in ctx.journal.retaken:
        ctx.add(
            info(
                "checkpoint.changed",
                f"{path} changed since fix last wrote it (a new revision?): kept as the new "
                "original for revert",
                paths=[path],
            )
        )
    return FixResult(ctx.findings, ctx.journal.planned, ctx.extra, ctx.smoke)
