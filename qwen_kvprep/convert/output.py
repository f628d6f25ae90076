"""Where convert writes: OUT's rules, the staging folder beside it, its lock, the rename.

- OUT must not exist, or be an empty folder; it must not lie inside DIR, nor DIR inside it
  (a link is followed to where it leads: that is where the bytes would go).
- Everything is written into the staging folder `.<OUT name>.convert-partial` beside OUT,
  and renamed to OUT at the very end: OUT appears complete or not at all. The staging
  folder's name starts with a dot and its config.json is written last, so what a killed run
  leaves behind is nothing a loader picks up.
- The lock file `.<OUT name>.convert-lock` beside OUT (filelock: the kernel drops it when
  its holder dies) keeps two converts from writing the same OUT; it is removed at the end.
  Under it, a staging folder left by a killed run (it holds our marker file) is removed
  and the conversion starts afresh, so the same command finishes what a kill cut short.
  A folder of that name without our marker is not ours: refused, never removed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

import filelock

from qwen_kvprep.convert.outname import suggested_out
from qwen_kvprep.errors import FileSystemError, KvprepError, LockTimeout, UsageError, os_failure
from qwen_kvprep.fsutil import fsync_dir

STAGING_SUFFIX = ".convert-partial"
LOCK_SUFFIX = ".convert-lock"
MARKER = ".qwen-kvprep-convert"  # inside the staging folder: it is ours to remove


def staging_of(out: Path) -> Path:
    return out.parent / f".{out.name}{STAGING_SUFFIX}"


def lock_of(out: Path) -> Path:
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_out(src: Path, out: Path) -> None:
    """UsageError unless OUT may be written: absent or an empty folder, apart from DIR, in a
    folder that exists. Reads only."""
    q = shlex.quote
    if out.name in ("", ".", ".."):
        raise UsageError(f"OUT {out}: name the folder to create (e.g. {q(str(out))}/qwen2)")
    real_out, real_src = out.resolve(), src.resolve()
    if _inside(real_out, real_src):
        raise UsageError(
            f"OUT {out} lies inside DIR {src}: convert never writes into the checkpoint",
            fix="name a folder outside it, e.g. " + q(str(suggested_out(real_src))),
        )
    if _inside(real_src, real_out):
        raise UsageError(
            f"DIR {src} lies inside OUT {out}: OUT would contain the checkpoint it is made from",
            fix="name an OUT folder beside DIR, not above it",
        )
    parent = out.parent
    if not parent.is_dir():
        raise UsageError(
            f"OUT {out}: the folder {parent} does not exist",
            fix=f"create it first (mkdir -p {q(str(parent))})",
        )
    if os.path.lexists(out):
        if out.is_symlink() or not out.is_dir():
            what = "a symlink" if out.is_symlink() else "not a folder"
            raise UsageError(
                f"OUT {out} exists and is {what}: convert creates OUT as a folder of its own "
                "(renamed into place at the end)",
                fix="name a new folder (convert creates it)",
            )
        try:
            entries = os.listdir(out)
        except OSError as exc:
            raise os_failure(exc, parent, output_option=False) from exc
        if entries:
            shown = ", ".join(sorted(entries)[:3]) + (" ..." if len(entries) > 3 else "")
            raise UsageError(
                f"OUT {out} exists and is not empty ({shown}): convert writes a new folder "
                "and never mixes its files with others",
                fix=f"name a new folder, or remove this one first (rm -r {q(str(out))}) if it "
                "holds nothing you need",
            )


def check_space(out: Path, needed: int) -> None:
    """FileSystemError when the device holding OUT's folder has less than `needed` bytes."""
    try:
        free = shutil.disk_usage(out.parent).free
    except OSError:
        return
    if free < needed:
        raise FileSystemError(
            f"not enough space for OUT: {_size(needed)} to write, {_size(free)} free on the "
            f"device holding {out.parent}",
            fix=f"free some space there (`df -h {shlex.quote(str(out.parent))}` shows it) or "
            "name an OUT on another disk; nothing was written",
        )


def _size(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def no_space(exc: OSError, out: Path) -> KvprepError:
    """The error for a write refused with ENOSPC (or any OSError) while staging OUT."""
    err = os_failure(exc, out.parent, output_option=False)
    if "no space left" in err.message:
        err.fix = (
            f"free some space on the device holding {out.parent} (`df -h "
            f"{shlex.quote(str(out.parent))}`) and run the same command again: it starts "
            "afresh (the partial output was removed)"
        )
    return err


@contextlib.contextmanager
def staged(out: Path, timeout: float = 0.0) -> Iterator[Path]:
    """The fresh staging folder for OUT, under OUT's lock, for the `with` block; removed if
    the block raises. `publish` renames it to OUT inside the block."""
    lock_path = lock_of(out)
    lock = filelock.FileLock(str(lock_path), timeout=timeout)
    try:
        lock.acquire()
    except filelock.Timeout as exc:
        raise LockTimeout(
            f"another convert is writing {out} (it holds {lock_path})",
            fix="wait for it to finish; a killed one releases the lock at once",
        ) from exc
    except OSError as exc:
        raise os_failure(exc, out.parent, output_option=False) from exc
    staging = staging_of(out)
    try:
        _clear_stale(staging)
        try:
            staging.mkdir()
            (staging / MARKER).write_bytes(b"")
        except OSError as exc:
            raise os_failure(exc, out.parent, output_option=False) from exc
        try:
            yield staging
        except BaseException:
            with contextlib.suppress(OSError):
                if staging.is_dir():
                    shutil.rmtree(staging)
            raise
    finally:
        with contextlib.suppress(OSError):
            lock_path.unlink()  # while held: a waiter then finds OUT complete and refuses
        lock.release()


def _clear_stale(staging: Path) -> None:
    if not os.path.lexists(staging):
        return
    if staging.is_symlink() or not (staging / MARKER).is_file():
        raise UsageError(
            f"{staging} exists and was not made by convert: it is left alone",
            fix=f"move it away (it is the name convert stages OUT in): mv "
            f"{shlex.quote(str(staging))} SOMEWHERE",
        )
    try:
        shutil.rmtree(staging)  # a killed run's partial output: start afresh
    except OSError as exc:
        raise os_failure(exc, staging.parent, output_option=False) from exc


def publish(staging: Path, out: Path) -> None:
    """Rename the complete staging folder to OUT (replacing an empty OUT folder)."""
    (staging / MARKER).unlink()
    fsync_dir(staging)
    try:
        os.replace(staging, out)
    except OSError as exc:
        (staging / MARKER).write_bytes(b"")  # still ours, still removable
        raise os_failure(exc, out.parent, output_option=False) from exc
    fsync_dir(out.parent)
