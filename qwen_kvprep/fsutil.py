"""Atomic file writes (a crash never leaves a half-written file behind), and removing a
folder without crossing into a mount."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import stat
import tempfile
from pathlib import Path
from typing import Union

from qwen_kvprep.errors import UsageError
from qwen_kvprep.untrusted import kind_of

PathLike = Union[str, "os.PathLike[str]"]


def check_folder_of(path: Path, option: str, error: type[UsageError] = UsageError) -> None:
    """A usage error naming `option` when the folder a file is to be written into does not
    exist: said before any work, where the atomic write would fail at the end naming its
    temporary file."""
    folder = path.absolute().parent
    if not folder.is_dir():
        raise error(
            f"{option} {path}: the folder {folder} does not exist",
            fix=f"create it first (mkdir -p {shlex.quote(str(folder))}), or name a file in a "
            "folder that exists",
        )


def check_output_file(
    path: Path, option: str, error: type[UsageError] = UsageError, fix: str = ""
) -> None:
    """check_folder_of, and a usage error when `path` exists as anything but a regular file.

    The write replaces what is at `path` with a new file: a device, a FIFO or a symlink
    there (`-o /dev/stdout` is a link to one) would be replaced, not written to, and as
    root a device node in /dev is replaced as readily as a file."""
    check_folder_of(path, option, error)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise error(f"{option} {path} cannot be examined: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(mode):
        raise error(
            f"{option} {path} is {kind_of(mode)}, not a regular file: writing would replace "
            "it with one",
            fix=fix or "name a regular file, or a new one",
        )


def atomic_write_bytes(path: PathLike, data: bytes, mode: int | None = None) -> None:
    """Write via a temp file in the same folder, fsync, then os.replace.

    If `path` is a symlink, the link itself is replaced by a regular file: the target
    (for example a huggingface_hub blob) is never written through.
    """
    target = Path(path)
    folder = target.parent
    if mode is None:
        try:
            mode = target.stat().st_mode & 0o777
        except OSError:
            mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def atomic_write_text(path: PathLike, text: str, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def fsync_dir(folder: PathLike) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_symlink(target: str, link: PathLike) -> None:
    """Create or replace `link` -> `target` atomically."""
    link = Path(link)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.lnk")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)


# Temporary files our atomic writes create: `.<name>.<8 random>.tmp` (atomic_write_bytes,
# the journal, prestart's quick start), `.<name>.<pid>.lnk` (atomic_symlink),
# `.<name>.revert` (revert before 0.2).
TEMP_NAME = re.compile(r"^\.(.+)\.(?:[a-z0-9_]{8}\.tmp|\d+\.lnk|revert)$")


def leftover_temps(folder: PathLike) -> list[str]:
    """The names of temporary files of ours in `folder` (none when it cannot be listed):
    what a write killed half-way leaves. Lists only; dirlock removes them."""
    try:
        entries = sorted(os.listdir(folder))
    except OSError:
        return []
    return [e for e in entries if TEMP_NAME.match(e) and os.path.isfile(os.path.join(folder, e))]


# -- removing a folder without crossing into another file system ---------------------------


def _unescape_mount(field: str) -> str:
    """A path as /proc/self/mountinfo writes it: space, tab, newline and backslash octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> set[str]:
    """Every mount point this process sees (empty where the kernel does not say). A bind
    mount of a folder of the same file system shares its device number with what is
    around it: only this list tells it apart."""
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return set()
    points = set()
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:
            points.add(_unescape_mount(fields[4]))
    return points


def is_mount(path: PathLike) -> bool:
    """Whether `path` is a mount point, a bind mount of a folder of the same file system
    included (which os.path.ismount does not see)."""
    return os.path.ismount(path) or os.path.realpath(path) in mount_points()


def remove_tree(folder: PathLike) -> bool:
    """Remove `folder` and what it holds as `rm -r --one-file-system` does: a folder on
    another device or mounted there (a bind mount included), and all below it, is left
    alone, as is the folder itself when it is such a mount; links are removed, never
    followed. Every path is opened relative to its parent's descriptor, so a folder
    swapped for a link meanwhile leads nowhere. Errors are ignored (what cannot be removed
    stays). Returns whether `folder` is gone."""
    top = os.path.realpath(folder)
    mounts = mount_points()
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return not os.path.lexists(folder)
    try:
        device = os.fstat(fd).st_dev
        if top in mounts:
            return False
        with contextlib.suppress(RecursionError):  # nesting past Python's limit: stays
            _empty(fd, top, device, mounts)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(folder)
    return not os.path.lexists(folder)


def _empty(fd: int, where: str, device: int, mounts: set[str]) -> None:
    """Remove what the folder open as `fd` (at the real path `where`) holds, but mounts."""
    try:
        names = os.listdir(fd)
    except OSError:
        return
    for name in names:
        path = os.path.join(where, name)
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if st.st_dev != device or path in mounts:
            continue  # another file system (or a bind mount of this one): not ours to empty
        if not stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
            continue
        try:
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError:
            continue
        try:
            opened = os.fstat(sub)
            if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                continue  # swapped since the stat above
            _empty(sub, path, device, mounts)
        finally:
            os.close(sub)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=fd)
