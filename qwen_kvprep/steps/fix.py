"""`fix`: validate → choose sources → patch config → build → loader → modules cache →
state → smoke. Each step reads and extends one FixContext."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from qwen_kvprep.errors import KvprepError
from qwen_kvprep.findings import Finding
from qwen_kvprep.journal import Journal, PlannedWrite


@dataclass(frozen=True)
class FixOptions:
    dry_run: bool = False
    build: bool = True
    smoke: bool = True
    source: str = "auto"
    repo_id: Optional[str] = None
    revision: Optional[str] = None
    cache_dir: Optional[Path] = None
    arch: Optional[str] = None
    smoke_timeout: Optional[float] = None
    # --output OUT: fix a view of the directory in OUT and leave the directory untouched
    output: Optional[Path] = None
    # huggingface_hub's download bars: None = only when stderr is a terminal; False for --json
    progress: Optional[bool] = None


@dataclass
class FixContext:
    directory: Path
    options: FixOptions
    journal: Journal
    findings: list[Finding] = field(default_factory=list)
    facts: Any = None  # probe.facts.Facts with the checkpoint part
    sources: Any = None  # chosen kernel sources (steps.sources)
    build: Any = None  # the build used (steps.build)
    extra: dict[str, Any] = field(default_factory=dict)  # JSON output additions

    def add(self, *findings: Finding) -> None:
        self.findings.extend(findings)


@dataclass(frozen=True)
class FixResult:
    findings: list[Finding]
    planned: list[PlannedWrite]
    extra: dict[str, Any]


# (module, condition): steps run in this order; a step raises a KvprepError to stop.
_STEPS: list[tuple[str, Callable[[FixOptions], bool]]] = [
    ("validate", lambda o: True),
    ("sources", lambda o: True),
    ("config_patch", lambda o: True),
    ("build", lambda o: True),  # reports --no-build itself (the loader then builds lazily)
    ("loader", lambda o: True),
    ("modules", lambda o: True),
    ("state", lambda o: True),
    # last: proves the result (a child process loads the model); dry-run has nothing to prove
    ("smoke", lambda o: o.smoke and not o.dry_run),
]


def run_fix(directory: Path, options: FixOptions) -> FixResult:
    view_findings: list[Finding] = []
    if options.output is not None:
        from qwen_kvprep.view import fix_target

        directory, view_findings = fix_target(directory, options.output, options.dry_run)
    # Concurrent fixes of one directory (replicas starting together) take turns: each
    # loads the journal only once it holds the lock, so no original is recorded twice.
    # A dry run writes nothing and needs no turn.
    with contextlib.ExitStack() as stack:
        if not options.dry_run:
            from qwen_kvprep.buildcache.builder import stderr_notify
            from qwen_kvprep.buildcache.lock import directory_lock, lock_timeout

            what = f"qwen-kvprep fix of {directory}"
            stack.enter_context(directory_lock(directory, lock_timeout(), stderr_notify, what))
        ctx = FixContext(directory, options, Journal(directory, dry_run=options.dry_run))
        ctx.add(*view_findings)
        for name, wanted in _STEPS:
            if wanted(options):
                try:
                    importlib.import_module(f"qwen_kvprep.steps.{name}").run(ctx)
                except KvprepError as exc:
                    # what the earlier steps found (a warning about replaced files, say)
                    # belongs in the refusal too, before the reason itself
                    seen = {id(f) for f in exc.findings}
                    earlier = [f for f in ctx.findings if id(f) not in seen]
                    exc.findings = (*earlier, *exc.findings)
                    raise
    return FixResult(ctx.findings, ctx.journal.planned, ctx.extra)
