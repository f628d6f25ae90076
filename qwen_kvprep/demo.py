"""`qwen-kvprep demo`: the whole path on a tiny generated model, explained to a newcomer.

Generate a tiny Qwen (v1) compatible checkpoint (qwen_kvprep.tiny), run `fix` on it
exactly as on a real one (validate, sources, config, build, loader, modules cache, state,
smoke), and tell what happened and what was measured.

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
from typing import Any, Callable, Optional

from qwen_kvprep.errors import KvprepError, UsageError
from qwen_kvprep.findings import Finding, Severity, fail

CHECKPOINT_NAME = "tiny-qwen"  # no dot: transformers turns the folder name into a module
MARKER = ".qwen-kvprep-demo"
Echo = Callable[[str], None]


@dataclass(frozen=True)
class DemoOptions:
    directory: Optional[Path] = None  # None: a temporary folder, removed afterwards
    cache_dir: Optional[Path] = None
    progress: bool = False
    smoke_timeout: Optional[float] = None


@dataclass
class DemoResult:
    base: Path
    checkpoint: Path
    kept: bool
    findings: list[Finding] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    error: Optional[KvprepError] = None
    background_build: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and not any(f.severity is Severity.FAIL for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.base),
            "checkpoint": str(self.checkpoint),
            "kept": self.kept,
            "model": self.model,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "background_build": self.background_build,
            "fix": {k: v for k, v in self.extra.items() if k != "smoke"},
            "smoke": self.extra.get("smoke"),
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


def _model_info(checkpoint: Path) -> dict[str, Any]:
    cfg = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    weights = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    dtype = next((d for d in ("bf16", "fp16", "fp32") if cfg.get(d)), "auto")
    return {
        "layers": cfg.get("num_hidden_layers"),
        "heads": cfg.get("num_attention_heads"),
        "head_dim": cfg.get("kv_channels"),
        "hidden_size": cfg.get("hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
        "dtype": dtype,
        "weights_bytes": weights,
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
        self.info: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._work, name="demo-build", daemon=True)

    def _work(self) -> None:
        from qwen_kvprep.buildcache import CacheLayout, resolve_cache_dir, vendored_sources
        from qwen_kvprep.buildcache.builder import ensure_build, find_build, plan_build

        t0 = time.monotonic()
        try:
            layout = CacheLayout(resolve_cache_dir(self.cache_dir))
            plan = plan_build(vendored_sources(), None)
            if find_build(layout, plan.key) is not None:
                return
            built = ensure_build(plan, layout, notify=self.notify)
            self.info = {"compiled": built.compiled, "key": built.key, "mode": plan.mode,
                         "seconds": time.monotonic() - t0}
        except Exception as exc:  # fix's build step repeats it and reports it
            self.info = {"error": f"{type(exc).__name__}: {exc}"}

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        self.thread.join()


def run_demo(options: DemoOptions, echo: Optional[Echo] = None) -> DemoResult:
    """Generate, fix and smoke a tiny checkpoint. Failures of fix come back in the result
    (error, findings); the temporary folder is removed in every case."""
    from qwen_kvprep.steps.fix import FixOptions, run_fix
    from qwen_kvprep.tiny import generate_checkpoint

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
        say("generating a tiny Qwen (v1) compatible checkpoint ...")
        t0 = time.monotonic()
        generate_checkpoint(result.checkpoint)
        result.seconds["generate"] = time.monotonic() - t0
        result.model = _model_info(result.checkpoint)
        if background.thread.is_alive():
            # joined before fix rather than left for fix's build step to wait on the
            # lock: that would report our own thread as "another builder"
            say("compiling the kernel extension (the one slow step; cached afterwards) ...")
            # fix imports these later anyway; now the compiler leaves this core idle
            import transformers.dynamic_module_utils  # noqa: F401

            from qwen_kvprep.checks import load_all

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
                ),
            )
            result.findings = list(fixed.findings)
            result.extra = dict(fixed.extra)
        except KvprepError as exc:
            result.error = exc
            result.findings = list(exc.findings) or [fail("smoke.demo", exc.message, fix=exc.fix)]
        result.seconds["fix"] = time.monotonic() - t0
    finally:
        result.seconds["total"] = time.monotonic() - t_all
        if not kept:
            shutil.rmtree(base, ignore_errors=True)
    return result


# -- the story ---------------------------------------------------------------------------


def _of(findings: list[Finding], *prefixes: str) -> list[Finding]:
    return [f for f in findings if f.id.startswith(prefixes)]


def _mark(f: Finding) -> str:
    return {Severity.WARN: " (warning)", Severity.FAIL: " (FAILED)"}.get(f.severity, "")


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _smoke_lines(smoke: dict[str, Any]) -> list[str]:
    if not smoke:
        return []
    if smoke.get("error"):
        return [f"the smoke test failed: {smoke['error']}"]
    lines = []
    load = smoke.get("load_seconds")
    dev = smoke.get("device_name") or smoke.get("device")
    if load is not None:
        lines.append(
            f"loaded the model as a server would (from_pretrained, trust_remote_code) on {dev} "
            f"in {load:.1f} s"
        )
    n, k = smoke.get("layers", 0), smoke.get("kernel_layers", 0)
    lines.append(
        f"the compiled kernel ran in {k}/{n} layers ({smoke.get('kernel_calls', 0)} calls)"
        + ("" if k == n and n else ": the model FELL BACK to the slow torch path")
    )
    kv = smoke.get("kv_bytes_per_token") or {}
    if kv.get("quantized") is not None and kv.get("unquantized"):
        line = (
            f"KV cache per token: {_num(kv['quantized'])} bytes instead of "
            f"{_num(kv['unquantized'])} ({kv['ratio']:.3f}x)"
        )
        if kv.get("head_dim") and kv.get("scale_bytes") and kv.get("element_bytes"):
            d, s, e = kv["head_dim"], kv["scale_bytes"], kv["element_bytes"]
            line += (
                f": each head stores {d} one-byte codes + a {s}-byte scale + a {s}-byte zero "
                f"point = {d + 2 * s} bytes for K and again for V, instead of {d * e}"
            )
        lines.append(line)
    ag = smoke.get("agreement") or {}
    if ag.get("tokens"):
        same, total = ag.get("identical_tokens"), ag.get("tokens")
        rel = ag.get("first_step_rel_logit_diff") or 0.0
        if ag.get("first_divergence") is None:
            lines.append(
                f"quantized and unquantized generations agree on {same}/{total} tokens; "
                f"the first step's logits differ by at most {rel:.1%} of their range"
            )
        else:
            lines.append(
                f"quantized and unquantized generations agree on the first "
                f"{ag['first_divergence']}/{total} tokens; first-step logits within {rel:.1%}"
            )
    tps = smoke.get("tokens_per_s") or {}
    peak = smoke.get("peak_memory") or {}
    if tps.get("quantized") and tps.get("unquantized"):
        what = "GPU peak" if peak.get("kind") == "cuda_max_allocated" else "peak RSS"
        lines.append(
            f"speed: {tps['quantized']:.0f} tokens/s quantized, {tps['unquantized']:.0f} "
            f"unquantized; {what} {peak.get('bytes', 0) / 2**20:.0f} MiB (a tiny model: this "
            "says nothing about real speed)"
        )
    return lines


def narrative(result: DemoResult) -> str:
    """What happened, numbered, in words a newcomer follows."""
    f = result.findings
    m = result.model
    out = ["qwen-kvprep demo: the Int8 KV-cache path on a tiny random model (no download)", ""]
    step = 0

    def add(head: str, items: list[str]) -> None:
        nonlocal step
        step += 1
        out.append(f"{step}. {head}")
        out.extend(f"   - {line}" for line in items)

    if m:
        add(
            f"generated a tiny Qwen (v1) compatible model in {result.checkpoint} "
            f"({result.seconds.get('generate', 0):.1f} s)",
            [
                f"{m['layers']} layers, {m['heads']} heads of dim {m['head_dim']}, {m['dtype']}, "
                f"{_size(m['weights_bytes'])} of weights, qwen-kvprep's own remote code"
            ],
        )
    groups = (
        ("checked it like a real checkpoint", ("checkpoint.",), ("checkpoint.state",)),
        ("chose the kernel sources", ("kernels.",), ()),
        ("patched config.json", ("config.",), ()),
        ("got the kernel extension", ("build.mode", "build.build"), ()),
        ("installed the loader and the modules cache", ("build.loader", "modules."), ()),
        ("recorded the state", ("checkpoint.state",), ()),
    )
    bg = result.background_build
    for head, prefixes, exclude in groups:
        items = [x.message + _mark(x) for x in _of(f, *prefixes) if x.id not in exclude]
        if prefixes[0] == "build.mode" and bg.get("compiled"):
            items.insert(0, f"compiled it in the background while the model was generated "
                         f"({bg['seconds']:.0f} s; cached for every later fix on this machine)")
        if not items and prefixes == ("checkpoint.",) and m:
            items = ["every checkpoint check passed"]  # validate reports only problems
        if items:
            add(head, items)
    smoke = result.extra.get("smoke") or {}
    if smoke:
        add("smoke test, in a child process", _smoke_lines(smoke))
    problems = [x for x in f if x.severity in (Severity.WARN, Severity.FAIL)]
    if problems:
        out += ["", "Problems:"]
        for x in problems:
            out.append(f"  {x.severity.value.upper():4}  {x.id}: {x.message}")
            if x.fix:
                out.append(f"        fix: {x.fix}")
    out.append("")
    total = result.seconds.get("total", 0.0)
    if result.ok:
        out.append(f"Result: the Int8 KV cache works on this machine ({total:.0f} s in all).")
        out.append(
            "Next: qwen-kvprep fix /path/to/Qwen-7B-Chat  (the same steps on a real checkpoint)"
        )
    else:
        msg = result.error.message if result.error else "see the problems above"
        out.append(f"Result: FAILED ({total:.0f} s): {msg}")
        out.append("Next: qwen-kvprep doctor  (explains what is wrong in this environment)")
    cache = result.extra.get("cache_dir")
    if cache:
        out.append(f"Build cache: {cache}")
    where = f"kept in {result.base}" if result.kept else f"removed ({result.base})"
    out.append(f"Demo files: {where}")
    return "\n".join(out)
