"""The one exception hierarchy. The CLI maps it to messages and exit codes in one place."""

from __future__ import annotations

import errno
import os
import shlex
from collections.abc import Iterable, Sequence
from typing import Optional, TypeVar, Union

from qwen_kvprep.findings import Finding, fail

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_E = TypeVar("_E", bound="KvprepError")


class KvprepError(Exception):
    """An expected failure: printed as a message (never a traceback) and mapped to an exit code."""

    exit_code = EXIT_FAILED

    def __init__(
        self,
        message: str,
        *,
        fix: Optional[str] = None,
        findings: Sequence[Finding] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.findings = tuple(findings)

    @classmethod
    def failing(
        cls: type[_E],
        id: str,
        message: str,
        fix: Optional[str] = None,
        paths: Iterable[object] = (),
        **details: object,
    ) -> _E:
        """The error with the one failing finding `id` that says the same: its message,
        fix, paths and details."""
        return cls(message, fix=fix, findings=[fail(id, message, fix, paths, details=details)])


class UsageError(KvprepError):
    """Bad invocation: an unknown option value, a missing directory, an unknown check id."""

    exit_code = EXIT_USAGE


class RefusedError(KvprepError):
    """The tool will not do what was asked, for a reason the findings carry."""


class CheckpointError(RefusedError):
    """The checkpoint directory is unusable as it is."""


class ConfigError(RefusedError):
    """config.json cannot be read or patched."""


class SourceError(RefusedError):
    """Kernel sources could not be found, fetched or verified."""


class BuildError(KvprepError):
    """Compiling the extension failed."""


class LockTimeout(KvprepError):
    """Another process held the build lock longer than we were willing to wait."""


class CacheError(KvprepError):
    """A cache folder cannot be created or written."""


class StateError(RefusedError):
    """What an earlier run recorded (.qwen-kvprep/journal.json, originals/, state.json) is
    damaged, tampered with, or does not match the folder: nothing is changed."""


class FileSystemError(KvprepError):
    """The file system refused a read or write (read-only, full, not permitted)."""


def current_user() -> str:
    """`name (uid N)` of the user this process runs as, for permission messages."""
    uid = os.geteuid() if hasattr(os, "geteuid") else -1
    try:
        import pwd

        name = pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError, OSError):
        name = os.environ.get("USER") or "?"
    return f"{name} (uid {uid})"


_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def _existing(path: str) -> str:
    """`path`, or its nearest ancestor that exists."""
    while path and not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _inside(path: str, folder: str) -> bool:
    full, base = os.path.abspath(path), os.path.abspath(folder)
    return full == base or full.startswith(base.rstrip(os.sep) + os.sep)


def os_failure(
    exc: OSError,
    folder: Union[str, os.PathLike[str], None] = None,
    output_option: bool = True,
) -> KvprepError:
    """An OSError as something the user can act on (the caller raises it `from exc`).

    `folder` is the folder being prepared (DIR, or OUT with --output); `output_option`
    says whether `--output OUT` would help (fix and prestart) or not (revert). The path
    shown is the one written: a copy's or a rename's destination (filename2), not its
    source; one outside `folder` (the build cache, say) is advised on by its own folder."""
    path = exc.filename2 if exc.filename2 is not None else exc.filename
    if path is None:
        path = folder
    shown = os.fspath(path) if path is not None else "a file"
    where = _existing(os.path.dirname(shown))  # a temporary folder is gone by now
    if folder is not None and (path is folder or _inside(shown, os.fspath(folder))):
        where = os.fspath(folder)
    else:
        output_option = False  # a view of DIR writes to the same place
    q = shlex.quote
    code = exc.errno
    if code == errno.EROFS:
        fix = (
            f"prepare a writable view instead and serve from it: `qwen-kvprep fix {q(where)} "
            "--output OUT` (prestart takes --output too; OUT on a writable disk)"
            if output_option
            else "remount it writable (or run this where the folder is writable)"
        )
        return FileSystemError(f"{shown} is on a read-only file system", fix=fix)
    if code in _NO_SPACE:
        return FileSystemError(
            f"no space left on the device holding {where} (writing {shown})",
            fix=f"free some space there (`df -h {q(where)}` shows it) and run the command "
            "again; what was written so far is recorded and kept",
        )
    if code in (errno.EACCES, errno.EPERM):
        existing = _existing(shown)
        return FileSystemError(
            f"permission denied on {shown} for user {current_user()}",
            fix=f"run as the owner of {q(where)} (`ls -ld {q(existing)}` shows it), or give this "
            "user access to it"
            + (", or prepare a writable view with `--output OUT`" if output_option else ""),
        )
    detail = exc.strerror or str(exc)
    return FileSystemError(f"{shown}: {detail}", fix=None)
