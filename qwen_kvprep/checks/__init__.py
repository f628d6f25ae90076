"""Checks: pure functions from probed facts to findings, one module per area.

Every check is declared once, in its area's module (env, checkpoint, config, kernels,
caches for `build.` and `modules.`, state), with `@check(id, title, needs=...)` from
checks/registry.py. `load_all` imports the area modules, so that every check is
registered, and returns the registry.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from qwen_kvprep.checks.registry import AREAS, REGISTRY, Check, CheckFunc, Need, check, run_one
from qwen_kvprep.findings import Finding
from qwen_kvprep.probe.facts import Facts

__all__ = [
    "AREAS",
    "REGISTRY",
    "Check",
    "CheckFunc",
    "Need",
    "check",
    "load_all",
    "run_checks",
    "run_one",
]


def load_all() -> dict[str, Check]:
    """Import every area module (each registers its checks) and return the registry."""
    from qwen_kvprep.checks import (  # noqa: F401
        caches,
        checkpoint,
        config,
        converted,
        env,
        gptq,
        kernels,
        records,
    )

    return REGISTRY


def run_checks(facts: Facts, ids: Optional[Iterable[str]] = None) -> list[Finding]:
    registry = load_all()
    selected = list(registry.values()) if ids is None else [registry[i] for i in ids]
    out: list[Finding] = []
    for chk in selected:
        out.extend(run_one(chk, facts))
    return out
