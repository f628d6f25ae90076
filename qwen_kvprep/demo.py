"""`qwen-kvprep demo`: the whole path on a tiny generated model, explained to a newcomer.

Generate a tiny Qwen (v1) compatible checkpoint (qwen_kvprep.tiny), run `fix` on it
exactly as on a real one (validate, sources, config, build, loader, modules cache, state,
smoke), and return what happened and what was measured (qwen_kvprep.render tells it).

Where things go:
- the checkpoint and the Hugging Face caches (HF_HOME, HF_MODULES_CACHE) live in the demo
  folder (DIR, or a temporary one removed afterwards). The demo downloads nothing; private
  HF caches keep the tiny model's remote code out of the user's modules cache.
- the build cache is the user's (--cache-dir, $QWEN_KVPREP_CACHE, else the default): the
  extension the demo compiles is exactly the one `fix` needs for a real checkpoint on this
  machine, so the demo's one slow step is not wasted, and a second demo is fast.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, TypedDict

from qwen_kvprep.buildcache import CacheLayout, builder, resolve_cache_dir, vendored_sources
from qwen_kvprep.checks import load_all
from qwen_kvprep.errors import KvprepError, UsageError
from qwen_kvprep.findings import Finding, Severity, fail
from qwen_kvprep.jsontypes import as_json_object
from qwen_kvprep.steps.context import FixExtra
from qwen_kvprep.steps.fix import FixOptions, run_fix
from qwen_kvprep.tiny import generate_checkpoint

if TYPE_CHECKING:
    from qwen_kvprep.jsontypes import JSONObject
    from qwen_kvprep.smoke.evaluate import SmokeSummary

CHECKPOINT_NAME = "tiny-qwen"  # no dot: transformers turns the folder name into a module
MARKER = ".qwen-kvprep-demo"
Echo = Callable[[str], None]


@dataclass(frozen=True)
class DemoOptions:
    directory: Optional[Path] = None  # None: a temporary folder, removed afterwards
    cache_dir: Optional[Path] = None
    progress: bool = False
    smoke_timeout: Optional[float] = None
    gptq: bool = False  # an Int4 GPTQ checkpoint (needs the GPTQ backend)
    rerun: Optional[str] = None  # the demo's command line less --smoke-timeout (advice)


class _DemoModelHead(TypedDict):
    layers: int
    heads: int
    head_dim: int
    dtype: str
    weights_bytes: int


class DemoModel(_DemoModelHead, total=False):
    """The tiny model the demo generated (its config.json and weights)."""

    hidden_size: int
    vocab_size: int
    gptq: bool


class BuildTiming(TypedDict, total=False):
    """What the background build did: compiled or reused (key, mode, where, how long), or
    the error that fix's build step then repeats and reports."""

    compiled: bool
    reused: bool
    key: str
    mode: str
    cache: str
    seconds: float
    error: str


@dataclass
class DemoResult:
    base: Path
    checkpoint: Path
    kept: bool
    findings: list[Finding] = field(default_factory=list)
    extra: FixExtra = field(default_factory=FixExtra)  # fix's (FixResult.extra)
    smoke: Optional[SmokeSummary] = None  # the smoke fix ran (FixResult.smoke)
    model: Optional[DemoModel] = None  # what the tiny checkpoint is, once generated
    seconds: dict[str, float] = field(default_factory=dict)
    error: Optional[KvprepError] = None
    background_build: BuildTiming = field(default_factory=BuildTiming)

    @property
    def ok(self) -> bool:
        return self.error is None and not any(f.severity is Severity.FAIL for f in self.findings)

    def to_json(self) -> JSONObject:
        seconds: JSONObject = {k: round(v, 3) for k, v in self.seconds.items()}
        return {
            "directory": str(self.base),
            "checkpoint": str(self.checkpoint),
            "kept": self.kept,
            "model": as_json_object(self.model or {}),
            "seconds": seconds,
            "background_build": as_json_object(self.background_build),
            "fix": as_json_object({k: v for k, v in self.extra.items() if k != "smoke"}),
            "smoke": as_json_object(self.extra["smoke"]) if "smoke" in self.extra else None,
        }


def _prepare_base(directory: Optional[Path]) -> tuple[Path, bool]:
    """The demo folder, and whether it is kept. A given DIR must be empty or a previous
    demo's (whose generated parts are replaced)."""
    if directory is None:
        return Path(tempfile.mkdtemp(prefix="qwen-kvprep-demo-")), False
    base = Path(directory).absolute()
    if base.exists() and not base.is_dir():
        raise UsageError(f"{base} is not a directory")
    if base.exists() and any(base.iterdir()):
        if not (base / MARKER).exists():
            raise UsageError(
                f"{base} is not empty and not a previous demo's folder",
                fix="give an empty or new folder, or leave DIR out to use a temporary one",
            )
        for name in (CHECKPOINT_NAME, "hf"):
            shutil.rmtree(base / name, ignore_errors=True)
    base.mkdir(parents=True, exist_ok=True)
    (base / MARKER).write_text("made by `qwen-kvprep demo`; safe to delete\n", encoding="utf-8")
    return base, True


def _private_hf(base: Path) -> None:
    hf_home = base / "hf"
    os.environ["HF_HOME"] = str(hf_home)
    os.environ["HF_MODULES_CACHE"] = str(hf_home / "modules")
    # transformers reads these when it is first imported; after that a change is ignored
    # and the modules cache would be the wrong one.
    hub = sys.modules.get("transformers.utils.hub")
    if hub is not None and getattr(hub, "HF_MODULES_CACHE", None) != os.environ["HF_MODULES_CACHE"]:
        raise KvprepError(
            "demo must set HF_MODULES_CACHE before transformers is imported",
            fix="run `qwen-kvprep demo` in a fresh process",
        )


def _model_info(checkpoint: Path) -> DemoModel:
    """The generated checkpoint's geometry (the tiny generator writes every key)."""
    cfg: JSONObject = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    weights = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    dtype = next((d for d in ("bf16", "fp16", "fp32") if cfg.get(d)), "auto")

    def number(key: str) -> int:
        value = cfg.get(key)
        if not isinstance(value, int):
            raise KvprepError(f"the generated checkpoint's config.json has no {key}")
        return value

    return {
        "layers": number("num_hidden_layers"),
        "heads": number("num_attention_heads"),
        "head_dim": number("kv_channels"),
        "hidden_size": number("hidden_size"),
        "vocab_size": number("vocab_size"),
        "dtype": dtype,
        "weights_bytes": weights,
        "gptq": isinstance(cfg.get("quantization_config"), dict),
    }


class BackgroundBuild:
    """Compile the extension while the checkpoint is generated.

    The compile is the demo's one long step (a single C++ file against torch's headers,
    ~40 s of one core) and generating the model needs the other core: on a 2-core machine
    overlapping them is what keeps a cold demo under a minute. The demo joins it before
    fix, whose build step then finds the build in the cache. Any failure here is left to
    fix's build step, which repeats the build and reports it properly.
    """

    def __init__(self, cache_dir: Optional[Path], notify: Echo) -> None:
        self.cache_dir = cache_dir
        self.notify = notify
        self.info: BuildTiming = {}  # what it did: compiled/reused, key, mode, seconds; or error
        # set once the thread knows whether it compiles (the cache may already hold the
        # build): the demo then says "compiling" or "reusing", whichever is true
        self.decided = threading.Event()
        self.compiling = False
        self.thread = threading.Thread(target=self._work, name="demo-build", daemon=True)

    def _work(self) -> None:
        t0 = time.monotonic()
        try:
            layout = CacheLayout(resolve_cache_dir(self.cache_dir))
            plan = builder.plan_build(vendored_sources(), None)
            if builder.find_build(layout, plan.key) is not None:
                self.info = {"compiled": False, "reused": True, "key": plan.key,
                             "mode": plan.mode, "cache": str(layout.root)}
                return
            self.compiling = True
            self.decided.set()
            built = builder.ensure_build(plan, layout, notify=self.notify)
            self.info = {"compiled": built.compiled, "reused": not built.compiled,
                         "key": built.key, "mode": plan.mode,
                         "seconds": time.monotonic() - t0}
        except Exception as exc:  # fix's build step repeats it and reports it
            self.info = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.decided.set()

    def start(self) -> None:
        self.thread.start()

    def announce(self, say: Echo) -> None:
        """Say what the build is doing, once the thread knows: compiling (still under way),
        or reusing the build an earlier run left in the cache."""
        self.decided.wait()
        if self.compiling and self.thread.is_alive():
            say("compiling the kernel extension (the one slow step; cached afterwards) ...")
        elif self.info.get("reused"):
            say(f"reusing the kernel extension built earlier (build cache "
                f"{self.info.get('cache', '?')}): no compile needed")

    def join(self) -> None:
        self.thread.join()


def run_demo(options: DemoOptions, echo: Optional[Echo] = None) -> DemoResult:
    """Generate, fix and smoke a tiny checkpoint. Failures of fix come back in the result
    (error, findings); the temporary folder is removed in every case."""
    say = echo or (lambda _text: None)
    base, kept = _prepare_base(options.directory)
    result = DemoResult(base=base, checkpoint=base / CHECKPOINT_NAME, kept=kept)
    t_all = time.monotonic()
    try:
        _private_hf(base)
        # The tiny model's matrices are too small to gain from a second thread, and on a
        # busy machine OpenMP's spinning barriers make two threads ~100x slower than one
        # (measured on the 2-core CI machine under load: 3 vs 425 tokens/s). The smoke
        # child inherits this; a user's own setting wins.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # torch is imported here, not first in the build thread: two threads importing
        # a large extension package at once is asking for import-lock trouble
        import torch  # noqa: F401

        background = BackgroundBuild(options.cache_dir, say)
        background.start()
        say(
            "generating a tiny Qwen (v1) compatible checkpoint"
            + (" (GPTQ Int4)" if options.gptq else "") + " ..."
        )
        t0 = time.monotonic()
        generate_checkpoint(result.checkpoint, gptq=options.gptq)
        result.seconds["generate"] = time.monotonic() - t0
        result.model = _model_info(result.checkpoint)
        background.announce(say)
        if background.thread.is_alive():
            # joined before fix rather than left for fix's build step to wait on the
            # lock: that would report our own thread as "another builder".
            # fix imports these later anyway; now the compiler leaves this core idle
            import transformers.dynamic_module_utils  # noqa: F401


            load_all()
        background.join()
        result.background_build = background.info
        say("running fix: validate, sources, config, build, loader, modules, state, smoke ...")
        t0 = time.monotonic()
        try:
            fixed = run_fix(
                result.checkpoint,
                FixOptions(
                    cache_dir=options.cache_dir,
                    progress=options.progress,
                    smoke_timeout=options.smoke_timeout,
                    rerun=options.rerun,
                    force_smoke=True,  # the demo shows the smoke, even on a kept checkpoint
                ),
            )
            result.findings = list(fixed.findings)
            result.extra = fixed.extra
            result.smoke = fixed.smoke
        except KvprepError as exc:
            result.error = exc
            result.findings = list(exc.findings) or [fail("smoke.demo", exc.message, fix=exc.fix)]
        result.seconds["fix"] = time.monotonic() - t0
    finally:
        result.seconds["total"] = time.monotonic() - t_all
        if not kept:
            shutil.rmtree(base, ignore_errors=True)
    return result
