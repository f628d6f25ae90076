"""One finding type, shared by doctor, fix's refusals and --json."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol, Union


class Severity(str, enum.Enum):
    OK = "ok"
    INFO = "info"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {
    Severity.SKIP: 0,
    Severity.OK: 1,
    Severity.INFO: 2,
    Severity.WARN: 3,
    Severity.FAIL: 4,
}


@dataclass(frozen=True)
class Finding:
    """One observation. `id` is stable and dotted, starting with its area (`checkpoint.`, ...)."""

    id: str
    severity: Severity
    message: str
    fix: Optional[str] = None
    paths: Sequence[str] = ()
    # Extra facts for --json: JSON-friendly values (json.dumps falls back to str()).
    details: Mapping[str, object] = field(default_factory=dict)

    @property
    def area(self) -> str:
        return self.id.split(".", 1)[0]

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "id": self.id,
            "severity": self.severity.value,
            "message": self.message,
            "fix": self.fix,
            "paths": [str(p) for p in self.paths],
        }
        if self.details:
            out["details"] = dict(self.details)
        return out


class MakeFinding(Protocol):
    """`ok(id, message, fix, paths, details=..., **more)`: a Finding of one severity.
    `paths` are anything that prints as a path (str, pathlib.Path); the details are
    `details` (a mapping built beforehand) and the keyword arguments `more`."""

    def __call__(
        self,
        id: str,
        message: str,
        fix: Optional[str] = None,
        paths: Iterable[object] = (),
        *,
        details: Optional[Mapping[str, object]] = None,
        **more: object,
    ) -> Finding: ...


def _mk(severity: Severity) -> MakeFinding:
    def make(
        id: str,
        message: str,
        fix: Optional[str] = None,
        paths: Iterable[object] = (),
        *,
        details: Optional[Mapping[str, object]] = None,
        **more: object,
    ) -> Finding:
        merged = {**details, **more} if details is not None else more
        return Finding(id, severity, message, fix, tuple(str(p) for p in paths), merged)

    return make


ok = _mk(Severity.OK)
info = _mk(Severity.INFO)
warn = _mk(Severity.WARN)
fail = _mk(Severity.FAIL)
skip = _mk(Severity.SKIP)

FindingsLike = Union[Finding, Iterable[Finding], None]


def as_list(result: FindingsLike) -> list[Finding]:
    if result is None:
        return []
    if isinstance(result, Finding):
        return [result]
    return list(result)


def failed(findings: Iterable[Finding], strict: bool = False) -> bool:
    limit = Severity.WARN if strict else Severity.FAIL
    return any(f.severity.rank >= limit.rank for f in findings)
