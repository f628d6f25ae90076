"""Checks: pure functions from probed facts to findings, registered under stable ids.

A check module registers its functions with `@check("area.name", "title")`. A function
takes `Facts` and returns a Finding, several Findings (all with the check's id), or None
(nothing to say). A check that raises is reported as its own failing finding.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable, Optional

from qwen_kvprep.findings import Finding, FindingsLike, as_list, fail
from qwen_kvprep.probe.facts import Facts

CheckFunc = Callable[[Facts], FindingsLike]

AREAS = ("env", "checkpoint", "config", "kernels", "build", "modules", "state", "smoke")


@dataclass(frozen=True)
class Check:
    id: str
    title: str
    func: CheckFunc

    @property
    def area(self) -> str:
        return self.id.split(".", 1)[0]


REGISTRY: dict[str, Check] = {}


def check(id: str, title: str) -> Callable[[CheckFunc], CheckFunc]:
    area = id.split(".", 1)[0]
    if area not in AREAS or "." not in id:
        raise ValueError(f"check id {id!r} must be dotted and start with one of {AREAS}")

    def register(func: CheckFunc) -> CheckFunc:
        if id in REGISTRY:
            raise ValueError(f"duplicate check id {id!r}")
        REGISTRY[id] = Check(id, title, func)
        return func

    return register


def load_all() -> dict[str, Check]:
    """Import every check module so that all checks are registered."""
    from qwen_kvprep.checks import _all  # noqa: F401

    return REGISTRY


def run_one(chk: Check, facts: Facts) -> list[Finding]:
    try:
        return as_list(chk.func(facts))
    except Exception as exc:  # a broken check must not hide the others
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
        return [
            fail(
                chk.id,
                f"the check itself crashed: {type(exc).__name__}: {exc}{where}",
                "report this as a qwen-kvprep bug, with `qwen-kvprep doctor --report`",
            )
        ]


def run_checks(facts: Facts, ids: Optional[Iterable[str]] = None) -> list[Finding]:
    registry = load_all()
    selected = list(registry.values()) if ids is None else [registry[i] for i in ids]
    out: list[Finding] = []
    for chk in selected:
        out.extend(run_one(chk, facts))
    return out
