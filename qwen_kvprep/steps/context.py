"""What the steps of `fix` share: the options, the chosen kernel sources, and the context
each step reads and extends.

Every step module imports this one, and `steps/fix.py` imports the steps (a table of their
`run` functions). Keeping these types here, below both, is what lets a step name
`FixContext` without a step importing `fix`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, TypedDict

from qwen_kvprep.buildcache.inventory import hold_build, vanished
from qwen_kvprep.buildcache.lock import lock_timeout
from qwen_kvprep.buildcache.paths import CacheLayout
from qwen_kvprep.common import sha256_bytes
from qwen_kvprep.findings import Finding, MakeFinding
from qwen_kvprep.journal.writer import Journal

if TYPE_CHECKING:
    from qwen_kvprep.buildcache.builder import BuildResult
    from qwen_kvprep.buildcache.variant import Chosen
    from qwen_kvprep.jsontypes import JSONObject
    from qwen_kvprep.probe.facts import Facts
    from qwen_kvprep.smoke.evaluate import SmokeSummary
    from qwen_kvprep.smoke.progress import StepLog
    from qwen_kvprep.state.reader import StateModules


@dataclass(frozen=True)
class FixOptions:
    dry_run: bool = False
    build: bool = True
    smoke: bool = True
    # run the smoke even when the recorded verdict still holds for the unchanged state
    force_smoke: bool = False
    # the Int8 cache's fast path in the model's code (steps/fastkv.py)
    fast_path: bool = True
    per_token_prefill: bool = False  # the fast path's per-token scales for prompts
    source: str = "auto"
    repo_id: Optional[str] = None
    revision: Optional[str] = None
    cache_dir: Optional[Path] = None
    arch: Optional[str] = None
    smoke_timeout: Optional[float] = None
    # the command line that ran fix, less --smoke-timeout: what a smoke that timed out
    # advises running again with more time (None: `qwen-kvprep smoke DIR --timeout S`)
    rerun: Optional[str] = None
    # --output OUT: fix a view of the directory in OUT and leave the directory untouched
    output: Optional[Path] = None
    # DIR as the user wrote it (a trailing slash, `.`, a symlink): the smoke loads by it
    spelling: Optional[str] = None
    # huggingface_hub's download bars: None = only when stderr is a terminal; False for --json
    progress: Optional[bool] = None
    quiet: bool = False  # -q: no notices on stderr either (the build's)
    # --prebuilt SOURCE: install a prebuilt variant instead of compiling (steps/prebuilt.py)
    prebuilt: Optional[str] = None


class FixExtra(TypedDict, total=False):
    """What fix adds to its --json document, each key set by the step that knows it."""

    sources: JSONObject  # SourceSet.to_json (steps/sources.py)
    cache_dir: str  # the build cache used (steps/build.py)
    build: JSONObject  # BuildResult.to_json, or the one reused (steps/build.py)
    loader: str  # the loader file (steps/loader.py)
    fast_path: bool  # whether the model's code got the fast path (steps/fastkv.py)
    compat: bool  # whether it got the compatibility module (steps/fastkv.py)
    modules: StateModules  # the modules-cache copies (steps/modules.py)
    state: str  # state.json (steps/record.py)
    prebuilt: JSONObject  # the variant installed for --prebuilt (steps/prebuilt.py)
    # the smoke's summary (SmokeSummary), or the verdict an earlier run recorded
    # (smoke/record.py) when nothing changed since (steps/smoke.py)
    smoke: JSONObject
    smoke_from_state: bool


@dataclass(frozen=True)
class SourceSet:
    """The two kernel source files the rest of `fix` builds and installs."""

    origin: str  # "vendored" | "hub" | "checkpoint" (kept what the directory had)
    kind: str  # catalogue.OFFICIAL | catalogue.OURS
    files: Mapping[str, bytes]
    repo_id: Optional[str] = None
    revision: Optional[str] = None
    commit: Optional[str] = None  # what the Hub resolved `revision` to

    def hashes(self) -> dict[str, str]:
        return {name: sha256_bytes(data) for name, data in self.files.items()}

    def to_json(self) -> JSONObject:
        files: JSONObject = dict(self.hashes())
        return {
            "origin": self.origin,
            "kind": self.kind,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "files": files,
        }


@dataclass
class FixContext:
    directory: Path
    options: FixOptions
    journal: Journal
    findings: list[Finding] = field(default_factory=list)
    facts: Optional[Facts] = None  # with the checkpoint part, once validated
    sources: Optional[SourceSet] = None  # chosen by steps/sources.py
    build: Optional[BuildResult] = None  # the build used (steps/build.py)
    # the key a dry run would build (no build yet): the loader it previews names it
    planned_key: Optional[str] = None
    prebuilt: Optional[Chosen] = None  # the verified variant for --prebuilt
    cache_id: Optional[str] = None  # the build cache's id (its marker), once a build is used
    modules: Optional[StateModules] = None  # what steps/modules.py planted where
    smoke: Optional[SmokeSummary] = None  # the smoke this run ran (steps/smoke.py)
    extra: FixExtra = field(default_factory=FixExtra)  # fix's --json additions
    # the recorded smoke verdict that still holds (steps/record.py): the smoke need not run
    proven: Optional[JSONObject] = None
    # progress lines for a log (stderr not a terminal); None: the terminal's own output
    log: Optional[StepLog] = None

    def add(self, *findings: Finding) -> None:
        self.findings.extend(findings)

    def use_build(self, result: BuildResult, make: MakeFinding, message: str) -> None:
        """Make `result` the build this run uses (in --json too) and say so as build.build,
        and record in the cache that this folder uses it (`cache list`, `cache prune`),
        then check under the build's lock that it is still there: BuildVanished when a
        prune removed it before the record was written (buildcache/inventory.hold_build)."""
        if not self.options.dry_run and result.dir.parent.name == "builds":
            layout = CacheLayout(result.dir.parent.parent)
            held, self.cache_id = hold_build(
                layout, result.key, result.manifest["so_sha256"],
                self.journal.identity["path"], lock_timeout(),
            )
            if not held:
                raise vanished(result.dir)
        self.build = result
        self.extra["build"] = result.to_json()
        self.add(make("build.build", message, paths=[result.dir], details=result.to_json()))
