"""`revert`: undo every change `fix` recorded in the checkpoint's journal.

Under the folder's lock (so a concurrent fix or prestart never interleaves), the journal
is read and every entry checked before any file is changed; see journal.Journal.revert.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from qwen_kvprep.buildcache.builder import stderr_notify
from qwen_kvprep.buildcache.lock import lock_timeout
from qwen_kvprep.common import STATE_DIRNAME, USERS_DIRNAME
from qwen_kvprep.dirlock import (
    OUR_FILES,
    TEMP_GRACE_S,
    finish_cut_revert,
    folder_lock,
    lock_path,
    refuse_foreign,
    remove_leftover_temps,
)
from qwen_kvprep.errors import StateError, os_failure
from qwen_kvprep.findings import fail
from qwen_kvprep.journal.reader import manual_recovery
from qwen_kvprep.journal.writer import Journal, prune_users
from qwen_kvprep.state.reader import read_state


@dataclass
class RevertResult:
    done: list[str] = field(default_factory=list)  # restored or removed
    notes: list[str] = field(default_factory=list)  # left alone, and why
    temps: list[str] = field(default_factory=list)  # leftover temporary files removed
    # what a revert killed after it removed the journal left, removed by this one
    finished: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # records of folders no longer prepared
    # the build cache fix recorded using (None: no build recorded); revert keeps it
    build_cache: Optional[Path] = None
    dry_run: bool = False


def recorded_build_cache(directory: Path) -> Optional[Path]:
    """The build cache the recorded build lives in (`<cache>/builds/<key>`), as fix
    recorded it in state.json; None when no build is recorded or the state is unusable."""
    state, _problem = read_state(str(directory))
    build = state.get("build") if state else None
    folder = build.get("dir") if isinstance(build, dict) else None
    if not isinstance(folder, str) or not folder:
        return None
    return Path(folder).parent.parent


def preview_revert(directory: Path) -> RevertResult:
    """What revert would do, checked as revert checks it, with nothing changed: no lock is
    taken (that would write one) and nothing is removed. Raises StateError as revert
    would."""
    directory = Path(directory)
    result = RevertResult(dry_run=True)
    refuse_foreign(directory)  # as revert's lock would
    if not (directory / STATE_DIRNAME).is_dir():
        return result
    result.build_cache = recorded_build_cache(directory)
    try:
        journal = Journal(directory)
        if not journal.exists:
            return result
        plan = journal.plan_revert()
    except OSError as exc:
        raise os_failure(exc, directory, output_option=False) from exc
    if plan.problems:
        recovery = manual_recovery(directory / STATE_DIRNAME)
        raise StateError(
            f"revert would be refused, nothing would be changed: {plan.problems[0]}",
            fix=recovery,
            findings=[fail("state.journal", p, recovery) for p in plan.problems],
        )
    result.done = [description for description, _action in plan.actions]
    result.notes = plan.notes
    return result


def revert_checkpoint(directory: Path) -> RevertResult:
    directory = Path(directory)
    result = RevertResult()
    if not (directory / STATE_DIRNAME).is_dir():
        return result  # nothing recorded: nothing to lock, nothing to do
    result.build_cache = recorded_build_cache(directory)  # before the state goes
    lock_existed = os.path.lexists(lock_path(directory))
    try:
        with folder_lock(directory, "qwen-kvprep command", lock_timeout(), stderr_notify):
            try:
                journal = Journal(directory)
                if not journal.exists:
                    # a revert killed after it removed the journal: finish it
                    result.finished = finish_cut_revert(directory)
                    return result
                plan_ok = not journal.plan_revert().problems
            except StateError:
                plan_ok = False
            if not plan_ok and not lock_existed:
                # a refused revert changes nothing: not even a lock file of its own
                with contextlib.suppress(OSError):
                    os.unlink(lock_path(directory))
            if plan_ok:
                result.temps = remove_leftover_temps(
                    directory, set(OUR_FILES)
                ) + remove_leftover_temps(directory / STATE_DIRNAME)
            journal = Journal(directory)
            planted = journal.planted_files
            result.done = journal.revert()
            result.notes = journal.notes
            if plan_ok:
                # what a killed fix or prestart left beside the files planted there
                for folder, names in _planted_folders(planted).items():
                    result.temps += remove_leftover_temps(folder, names, TEMP_GRACE_S)
                    result.temps += remove_leftover_temps(
                        folder / USERS_DIRNAME, None, TEMP_GRACE_S
                    )
                    result.stale += prune_users(folder)
    except OSError as exc:
        raise os_failure(exc, directory, output_option=False) from exc
    return result


def _planted_folders(planted: list[str]) -> dict[Path, set[str]]:
    """The modules-cache folders of these planted paths, each with the names planted."""
    out: dict[Path, set[str]] = {}
    for path in planted:
        out.setdefault(Path(path).parent, set()).add(os.path.basename(path))
    return out
