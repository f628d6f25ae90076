"""Atomic file writes: a crash never leaves a half-written file behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


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
