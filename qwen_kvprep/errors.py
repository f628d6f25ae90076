"""The one exception hierarchy. The CLI maps it to messages and exit codes in one place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from qwen_kvprep.findings import Finding

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


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


class SmokeError(KvprepError):
    """The smoke generation failed or proved the kernel is not used."""
