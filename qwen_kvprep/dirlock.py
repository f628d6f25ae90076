"""One lock per prepared folder, taken by `fix`, `prestart` (slow path) and `revert`.

`<DIR>/.qwen-kvprep/lock`, an OS lock through filelock (flock: the kernel drops it when its
holder dies, so a killed run never blocks the next one). `revert` removes `.qwen-kvprep/`,
lock file included, and a failed first `fix` removes the folder it created, both while
holding the lock; a waiter that then gets the lock on the removed file notices (the file
it locked is no longer the one at the path) and takes the lock again on the new one. The
lock is re-entrant within a process (prestart's slow path holds it around fix).

The folder is created only when the command is about to write: a refused command leaves
the model folder as it found it (`release_if_unused` removes a `.qwen-kvprep/` that holds
nothing but the lock). Where the folder cannot be created (a read-only DIR) the command
runs without the lock: it can write nothing there anyway, and says why.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, NoReturn, Optional

import filelock

from qwen_kvprep.common import (
    ENV_LOCK_TIMEOUT,
    LOCK_FILE,
    STATE_DIRNAME,
    STATE_FILE,
    TRACKED_FILES,
)
from qwen_kvprep.errors import LockTimeout, StateError
from qwen_kvprep.fsutil import TEMP_NAME
from qwen_kvprep.state.reader import foreign_item, removal_command


@dataclass
class _Held:
    lock: filelock.BaseFileLock
    depth: int  # how many folder_lock contexts of this thread hold it


# (thread, realpath of the state folder) -> the lock this process holds there.
# Per thread: another thread of this process waits like another process would.
_HELD: dict[tuple[int, str], _Held] = {}


def take(
    lock: filelock.BaseFileLock, timeout: float, poll: float, on_wait: Callable[[], None]
) -> Literal["free", "waited", "timeout"]:
    """Take an OS file lock (folder_lock's and the build cache's alike): at once when it is
    free, else after `on_wait()` (which says whom we wait for) within `timeout` seconds.
    OSErrors of filelock (a removed lock file) are the caller's."""
    try:
        lock.acquire(timeout=0)
        return "free"
    except filelock.Timeout:
        on_wait()
    try:
        lock.acquire(timeout=timeout, poll_interval=poll)
    except filelock.Timeout:
        return "timeout"
    return "waited"


def lock_path(directory: Path) -> Path:
    return Path(directory) / STATE_DIRNAME / LOCK_FILE


def _locked_fd(lock: filelock.BaseFileLock) -> Optional[int]:
    """The descriptor filelock holds the flock on (its attribute moved between versions)."""
    for holder in (getattr(lock, "_context", None), lock):
        for name in ("lock_file_fd", "_lock_file_fd"):
            fd = getattr(holder, name, None)
            if isinstance(fd, int):
                return fd
    return None


def _still_at_path(lock: filelock.BaseFileLock, path: Path) -> bool:
    """Whether the file we hold the flock on is still the one at `path` (a holder before
    us may have removed it, and someone else may have created a new one)."""
    fd = _locked_fd(lock)
    if fd is None:
        return path.exists()
    try:
        held = os.fstat(fd)
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


@contextlib.contextmanager
def folder_lock(
    directory: Path,
    what: str,
    timeout: float,
    notify: Callable[[str], None],
) -> Iterator[bool]:
    """Hold DIR's lock; yields whether a lock is really held (False: DIR is read-only)."""
    directory = Path(os.path.abspath(directory))
    state = directory / STATE_DIRNAME
    key = (threading.get_ident(), os.path.realpath(state))
    held = _HELD.get(key)
    if held is not None:
        held.depth += 1
        try:
            yield True
        finally:
            held.depth -= 1
        return
    path = state / LOCK_FILE
    deadline = time.monotonic() + timeout
    told = False
    while True:
        try:
            state.mkdir(exist_ok=True)
        except FileNotFoundError:
            raise  # the folder itself is gone (removed by a failed run we waited for)
        except OSError:
            # read-only (or otherwise unwritable): nothing can be written there, so there
            # is nothing to serialise; the command's first write reports why
            yield False
            return
        refuse_foreign(directory)
        lock = filelock.FileLock(str(path))

        def waiting() -> None:
            nonlocal told
            if not told:
                notify(
                    f"waiting for another {what} of {directory} (giving up after "
                    f"{timeout:.0f} s, see {ENV_LOCK_TIMEOUT})"
                )
                told = True

        try:
            taken = take(lock, max(0.0, deadline - time.monotonic()), 0.05, waiting)
        except FileNotFoundError:
            continue  # the holder removed the folder (revert): make it again and retry
        except OSError:
            yield False
            return
        if taken == "timeout":
            _timed_out(path, timeout)
        if not _still_at_path(lock, path):
            lock.release()
            if time.monotonic() > deadline:
                _timed_out(path, timeout)
            continue  # removed under us by revert or a failed fix: lock the new one
        break
    _HELD[key] = _Held(lock, 1)
    try:
        yield True
    finally:
        del _HELD[key]
        lock.release()


def _timed_out(path: Path, timeout: float) -> NoReturn:
    message = f"another qwen-kvprep kept {path} locked for more than {timeout:.0f} s"
    fix = (
        f"wait for it (`fuser {_q(path)}` shows it), or allow a longer wait with "
        f"{ENV_LOCK_TIMEOUT}=SECONDS"
    )
    raise LockTimeout.failing("build.lock", message, fix, [path])


def refuse_foreign(directory: Path) -> None:
    """StateError when DIR/.qwen-kvprep or its lock is not what qwen-kvprep made (a link, a
    FIFO...): a link there would make every write of ours land wherever it points. What
    every command that writes there refuses, for a preview to refuse too."""
    found = foreign_item(str(directory))
    if found is not None:
        item, kind, what = found
        raise StateError(
            f"{item} is {kind}, where qwen-kvprep keeps its own {what}: refusing to write "
            "through it",
            fix=f"remove it (`{removal_command(found)}`) if you did not put it there, then run "
            "the command again",
        )


def _q(path: object) -> str:
    import shlex

    return shlex.quote(str(path))


# The files fix writes in a model folder: only temporary files named after them are ours.
OUR_FILES = frozenset(TRACKED_FILES)

_OUR_TEMP = TEMP_NAME  # the temporary files our atomic writes create


# How old a temporary file in a folder others write to (the modules cache) must be before
# it counts as left by a killed write: ours are a few KiB, written and renamed at once.
TEMP_GRACE_S = 10.0


def remove_leftover_temps(
    folder: Path, names: Optional[set[str]] = None, older_than: float = 0.0
) -> list[str]:
    """Remove temporary files a killed write of ours left in `folder` (only those naming
    one of `names`, when given; only those older than `older_than` seconds, in a folder
    others may be writing to). Call it holding the folder's lock. Returns their names."""
    removed: list[str] = []
    now = time.time()
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        m = _OUR_TEMP.match(entry)
        if not m or (names is not None and m.group(1) not in names):
            continue
        path = Path(folder) / entry
        try:
            st = os.lstat(path)
            if older_than and now - st.st_mtime < older_than:
                continue
            if path.is_symlink() or path.is_file():
                path.unlink()
                removed.append(entry)
        except OSError:
            continue
    return removed


def finish_cut_revert(directory: Path) -> list[str]:
    """What a revert killed after removing the journal leaves in `.qwen-kvprep/` (the lock,
    a stale state.json, originals, temporary files), removed; anything else there stays.
    Call it holding the lock, only when there is no journal. Returns what was removed."""
    state = Path(directory) / STATE_DIRNAME
    try:
        entries = set(os.listdir(state))
    except OSError:
        return []
    removed: list[str] = []
    if STATE_FILE in entries and not (entries - {LOCK_FILE, STATE_FILE, "originals"} - {
        e for e in entries if _OUR_TEMP.match(e)
    }):
        with contextlib.suppress(OSError):
            (state / STATE_FILE).unlink()
            removed.append(str(state / STATE_FILE))
        # revert removes the journal only once every original is back in place
        with contextlib.suppress(OSError):
            for name in os.listdir(state / "originals"):
                if re.fullmatch(r"[0-9a-f]{64}", name):
                    (state / "originals" / name).unlink()
    if release_if_unused(directory):
        removed.append(str(state))
    return removed


def release_if_unused(directory: Path) -> bool:
    """Remove DIR/.qwen-kvprep/ when it holds nothing of value (only the lock, an empty
    originals/ and temporary files): what a refused or failed first run created. Call it
    holding the lock; returns whether it was removed."""
    state = Path(directory) / STATE_DIRNAME
    try:
        entries = set(os.listdir(state))
    except OSError:
        return False
    originals = state / "originals"
    extra = entries - {LOCK_FILE, "originals"}
    if any(not _OUR_TEMP.match(e) for e in extra):
        return False
    if "originals" in entries:
        try:
            stored = os.listdir(originals)
        except OSError:
            return False
        if any(not _OUR_TEMP.match(e) for e in stored):
            return False
        for entry in stored:
            with contextlib.suppress(OSError):
                (originals / entry).unlink()
    for entry in extra:
        with contextlib.suppress(OSError):
            (state / entry).unlink()
    with contextlib.suppress(OSError):
        originals.rmdir()
    with contextlib.suppress(OSError):
        (state / LOCK_FILE).unlink()
    try:
        state.rmdir()
    except OSError:
        return False
    return True
