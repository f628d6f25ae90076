"""Judge what the smoke child measured: findings and the "smoke" summary object.

A pure function of the child's outcome, so every verdict and threshold is testable
without loading a model.

Thresholds (why these):

- Logits, while the quantized and unquantized runs share a prefix: the largest
  |Δlogit| over the vocabulary must stay within MAX_REL_LOGIT_DIFF = 5 % of the
  unquantized logits' range (max − min) at that step. The uint8 format keeps one
  (scale, zero) pair per head and chunk, so each cached value is off by less than one
  step, range/255 ≈ 0.4 % of that head's value range (the cast truncates); on the tiny
  model that shows up as ≈ 0.6 % of the logit range. Kernels that drop the zero point, skip
  a product or misread the layout show 30–70 %. 5 % leaves an order of magnitude for
  larger models and is still far below what a broken kernel does.
- Tokens: greedy decoding may legitimately part ways where two tokens are nearly tied. A
  divergence is accepted when, on the shared prefix, the unquantized model preferred its
  own token over the quantized run's pick by no more than that same 5 % of the logit
  range (a margin the allowed logit error can flip); otherwise it fails. The fraction of
  identical tokens and the first divergence are reported either way.
- Bytes per token are exact arithmetic on the cache tensors; the measured ratio is also
  compared with the format's formula (`expected_ratio`), which catches a cache holding
  more than the format says.
"""

from __future__ import annotations

import shlex
import signal
from typing import Optional, TypedDict

from qwen_kvprep.common import fix_command, gptq_install
from qwen_kvprep.findings import Finding, Severity, fail, info, ok, skip, warn
from qwen_kvprep.smoke.kvtable import KvScore, judge_passage
from qwen_kvprep.smoke.protocol import (
    FALLBACK_WARNINGS,
    LOAD_PHASES,
    PHASE_WORDS,
    CacheLayer,
    CacheSummary,
    GptqModules,
    OwnCode,
    PeakMemory,
    SmokeResult,
)
from qwen_kvprep.smoke.runner import SmokeOptions, SmokeOutcome

MAX_REL_LOGIT_DIFF = 0.05


class ByMode(TypedDict):
    """One figure for each cache (None where it was not measured)."""

    quantized: Optional[float]
    unquantized: Optional[float]


class _KvBytes(TypedDict):
    quantized: Optional[float]
    unquantized: Optional[float]
    ratio: Optional[float]
    expected_ratio: Optional[float]  # what the format predicts


class KvBytes(_KvBytes, total=False):
    """KV-cache bytes per token of each run; the model's cache geometry where both
    layouts were recognised."""

    head_dim: int
    heads: Optional[int]
    layers: int
    scale_bytes: Optional[int]
    element_bytes: Optional[int]


class SmokeNumbers(TypedDict, total=False):
    """What was measured: in the summary and in smoke.measure's details (measurements()
    fills every key; not total only so that SmokeSummary, whose keys depend on how far the
    child got, can declare them by inheriting)."""

    kv_bytes_per_token: KvBytes
    tokens_per_s: ByMode
    prefill_seconds: ByMode
    load_seconds: Optional[float]
    peak_memory: Optional[PeakMemory]
    # per run (the allocator's peak is reset before each): CUDA only, RSS never drops
    peak_memory_by_run: Optional[ByMode]


class Agreement(TypedDict, total=False):
    """smoke.agreement's details: all of them, or none when the runs were not compared."""

    tokens: int
    identical_tokens: int
    fraction: Optional[float]
    first_divergence: Optional[int]
    first_step_max_abs_logit_diff: Optional[float]
    first_step_logit_range: Optional[float]
    first_step_rel_logit_diff: float
    max_rel_logit_diff: float
    divergence_rel_margin: Optional[float]
    threshold_rel_logit_diff: float


class Texts(TypedDict):
    quantized: Optional[str]
    unquantized: Optional[str]


class _SummaryHead(TypedDict):
    ok: bool
    device_requested: str
    timeout_s: float
    timed_out: bool
    elapsed_seconds: float


class SmokeSummary(_SummaryHead, SmokeNumbers, total=False):
    """The "smoke" object of --json and of state.json: `phase` and `error` when the child
    gave no result, the rest when it did."""

    phase: str
    error: str
    kv_cache: list[KvScore]  # the Int8 cache's passage score, where it is on
    device: Optional[str]
    device_name: Optional[str]
    torch: Optional[str]
    torch_cuda: Optional[str]
    transformers: Optional[str]
    model_dtype: Optional[str]
    cpu_threads: Optional[int]
    model_code: Optional[str]
    layers: int
    kernel_layers: int
    kernel_calls: int
    fast_layers: int  # layers that ran qwen-kvprep's fast path
    kernel_files: list[str]
    prompt: Optional[str]
    prompt_tokens: Optional[int]
    max_new_tokens: Optional[int]
    agreement: Agreement
    text: Texts
    gptq: GptqModules  # GPTQ checkpoints only


class _FailureDetails(TypedDict):
    phase: str
    timed_out: bool
    returncode: Optional[int]
    elapsed_seconds: float
    log_tail: list[str]


class FailureDetails(_FailureDetails, total=False):
    """smoke.load's or smoke.run's details; the exception when the child reported one."""

    exception: dict[str, Optional[str]]  # its type and message
    traceback: Optional[str]


def _q(path: object) -> str:
    return shlex.quote(str(path))

# Known causes, matched in the error text or the log tail (docs/qwen-v1.md, "How the model
# finds its kernel").
_HINTS = (
    (
        "./cache_autogptq_cuda_256.cpp",
        "the checkpoint still runs the original cpp_kernels.py, which compiles from paths "
        "relative to the working directory: run `qwen-kvprep fix {dir}`",
    ),
    (
        "compute_70",
        "the original cpp_kernels.py asks nvcc for sm_70, which CUDA 13 dropped: run "
        "`qwen-kvprep fix {dir}` to use the prebuilt extension instead",
    ),
    (
        "DeprecatedTypeProperties",
        "the official kernel sources do not compile against this torch: run "
        "`qwen-kvprep fix {dir}` (it uses qwen-kvprep's own kernel sources)",
    ),
    (
        # Qwen's code as shipped (without qwen_kvprep_compat.py) where that package is not
        # installed, or cannot be imported (transformers >= 4.57)
        "transformers_stream_generator",
        "Qwen's code as shipped does not load here (its chat_stream imports "
        "transformers_stream_generator, which cannot be imported here): run "
        "`qwen-kvprep fix {dir}`, which adds qwen_kvprep_compat.py (the model then needs "
        "no such package)",
    ),
    (
        "get_head_mask",
        "Qwen's code as shipped does not run on this transformers: run "
        "`qwen-kvprep fix {dir}`, which adds qwen_kvprep_compat.py",
    ),
    (
        "requires the following packages",
        "install the packages the error names (Qwen's code needs tiktoken and einops)",
    ),
    (
        "Loading a GPTQ quantized model requires",
        "this is a GPTQ Int4 checkpoint and its backend is missing: "
        + gptq_install().replace("{", "{{").replace("}", "}}"),
    ),
    (
        # what older transformers (4.37) say without any GPTQ package
        "No package metadata was found for auto-gptq",
        "this is a GPTQ Int4 checkpoint and its backend is missing: "
        + gptq_install().replace("{", "{{").replace("}", "}}"),
    ),
    (
        "out of memory",
        "the model does not fit this device: try --device cpu, or a machine with more "
        "memory",
    ),
)


def expected_ratio(head_dim: int, scale_bytes: int, element_bytes: int) -> float:
    """Quantized over unquantized KV bytes per token for the Qwen v1 format.

    Per layer, token and head, K and V each store D one-byte codes plus a scale and a zero
    point of `scale_bytes` each, against D values of `element_bytes` unquantized:
    ratio = (D + 2·s) / (D · e). D=128, bf16 (s = e = 2): 132/256 = 0.516.
    """
    return (head_dim + 2 * scale_bytes) / (head_dim * element_bytes)


def _quote(lines: list[str], n: int = 8) -> str:
    return "\n".join("        | " + line for line in lines[-n:])


def known_cause(text: str, directory: str) -> Optional[str]:
    """The fix for a known failure named in an error message or log (also used by profile)."""
    for needle, fix in _HINTS:
        if needle in text:
            return fix.format(dir=_q(directory))
    return None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _failed_phase(outcome: SmokeOutcome) -> str:
    """The phase the child failed in: as its error says, else the last one it announced."""
    return outcome.error.get("phase", outcome.phase) if outcome.error else outcome.phase


def _failure(outcome: SmokeOutcome, options: SmokeOptions, directory: str) -> Finding:
    phase = _failed_phase(outcome)
    fid = "smoke.load" if phase in LOAD_PHASES else "smoke.run"
    doing = PHASE_WORDS.get(phase, phase)
    details: FailureDetails = {
        "phase": phase,
        "timed_out": outcome.timed_out,
        "returncode": outcome.returncode,
        "elapsed_seconds": round(outcome.elapsed, 2),
        "log_tail": outcome.log_tail,
    }
    fix: Optional[str]
    if outcome.timed_out:
        message = (
            f"no answer after {options.timeout:g} s while {doing}; the child process and "
            "everything it started were killed"
        )
        command, option = options.rerun or (f"qwen-kvprep smoke {_q(directory)}", "--timeout")
        fix = (
            "a stale torch JIT `lock` file in the modules cache makes every load wait "
            f"forever: run `qwen-kvprep doctor {_q(directory)}`; a very large model may just "
            f"need more time: `{command} {option} {2 * options.timeout:g}`"
        )
    elif outcome.error is not None:
        err = outcome.error
        message = f"{err.get('type')} while {doing}: {err.get('message')}"
        details["exception"] = {"type": err.get("type"), "message": err.get("message")}
        details["traceback"] = err.get("traceback")
        fix = known_cause(f"{err.get('message')}\n" + "\n".join(outcome.log_tail), directory)
    elif outcome.returncode is not None and outcome.returncode < 0:
        message = (
            f"the child process died of {_signal_name(outcome.returncode)} while {doing}"
        )
        fix = known_cause("\n".join(outcome.log_tail), directory)
    else:
        message = (
            f"the child process exited with status {outcome.returncode} while {doing}, "
            "without a result"
        )
        fix = known_cause("\n".join(outcome.log_tail), directory)
    if outcome.log_tail:
        message += "\n      last lines of its output:\n" + _quote(outcome.log_tail)
    return fail(
        fid, message, fix=fix or f"run `qwen-kvprep doctor {_q(directory)}`", paths=[directory],
        **details,
    )


def _quantization(result: SmokeResult, directory: str) -> Finding:
    layers = result.get("layers") or []
    if not layers:
        return fail(
            "smoke.quantization",
            "the model has no layer with a use_cache_quantization flag: its remote code "
            "predates the Int8 KV cache",
            fix="use a Qwen (v1) checkpoint revision from late September 2023 or later",
            paths=[directory],
        )
    off = [row["name"] for row in layers if not row.get("use_cache_quantization")]
    if off:
        return fail(
            "smoke.quantization",
            f"the quantized KV cache is off in {len(off)} of {len(layers)} layers "
            f"({', '.join(off[:3])}{', ...' if len(off) > 3 else ''})",
            fix=f"run `qwen-kvprep fix {_q(directory)}` (sets use_cache_quantization in "
            "config.json)",
            paths=[directory],
            layers_off=off,
        )
    cache = (result.get("quantized") or {}).get("cache") or {}
    bad = []
    for i, layer in enumerate(cache.get("layers") or []):
        if layer.get("layout") != "quantized":
            bad.append(f"layer {i}: cache is {layer.get('layout')}, not (q, scale, zero)")
        elif layer.get("q_dtype") != "uint8" or layer.get("v_dtype") != "uint8":
            bad.append(f"layer {i}: codes are {layer.get('q_dtype')}, not uint8")
        elif not layer.get("per_token"):
            bad.append(
                f"layer {i}: scale {layer.get('scale_shape')} for codes "
                f"{layer.get('q_shape')} is not one per token [b, h, s, 1]"
            )
    if not cache.get("layers"):
        bad.append("the forward pass returned no cache")
    if bad:
        return fail(
            "smoke.quantization",
            "the cache tensors are not the Int8 format: " + "; ".join(bad[:3]),
            fix="the model's remote code does not quantize the cache as Qwen v1 does; "
            "compare its modeling_qwen.py with the official one",
            paths=[directory],
            problems=bad,
        )
    first = cache["layers"][0]
    return ok(
        "smoke.quantization",
        f"uint8 cache with per-token {first.get('scale_dtype')} scale and zero point in all "
        f"{len(layers)} layers",
        layers=len(layers),
    )


def _numbers(result: SmokeResult, directory: str) -> Finding:
    n = result.get("numbers")
    if n is None:
        return skip("smoke.numbers", "not checked by this smoke child")
    compat = ", ".join(result.get("compat") or []) or "nothing"
    if n["tensors_differ"] or n["buffers_differ"]:
        names = n["tensors_differ_names"] + n["buffers_differ_names"]
        return fail(
            "smoke.numbers",
            f"the loaded model does not hold the checkpoint's numbers under transformers "
            f"{result.get('transformers')}: {n['tensors_differ']} of {n['tensors_compared']} "
            f"stored tensors differ from the loaded ones and {n['buffers_differ']} of "
            f"{n['buffers_compared']} buffers from what the model's code computes "
            f"({', '.join(names)}); the model would serve other weights than the checkpoint's",
            fix=f"run `{fix_command(directory)}`, which adds the compatibility module for this "
            "transformers (qwen_kvprep_compat.py)",
            **n,
        )
    return ok(
        "smoke.numbers",
        f"the loaded model holds the checkpoint's numbers: {n['tensors_compared']} stored "
        f"tensors equal the loaded ones (compared at both ends) and {n['buffers_compared']} "
        f"buffers what the model's code computes ({n['seconds']:.1f} s; compatibility "
        f"changes for transformers {result.get('transformers')}: {compat})",
        **n,
    )


def _fallback_warnings(result: SmokeResult, log_tail: list[str]) -> list[str]:
    said = list(result.get("load_warnings") or [])
    known = [w for w in said if any(k in w for k in FALLBACK_WARNINGS)]
    if not known:  # model code that print()s instead of warning
        known = [k for k in FALLBACK_WARNINGS if any(k in line for line in log_tail)]
    return list(dict.fromkeys(known))


def _kernel(result: SmokeResult, log_tail: list[str], directory: str) -> Finding:
    layers = result.get("layers") or []
    if not layers or not all(row.get("use_cache_quantization") for row in layers):
        return skip("smoke.kernel", "not checked: the quantized cache is off")
    problems: list[str] = []
    fallback: list[str] = []
    for row in layers:
        kern = row.get("kernel") or {}
        name = row["name"]
        if not row.get("use_cache_kernel"):
            problems.append(f"{name}: use_cache_kernel is off")
        elif not kern.get("loaded"):
            fallback.append(name)
        elif not kern.get("compiled"):
            problems.append(
                f"{name}: cache_kernels is {kern.get('module')} "
                f"({kern.get('file') or 'no file'}), not a compiled extension"
            )
        elif not row.get("kernel_calls"):
            problems.append(f"{name}: the extension is loaded but was never called")
    said = _fallback_warnings(result, log_tail)
    if fallback:
        quoted = "; ".join(repr(w) for w in said) or "no warning was printed"
        which = "all" if len(fallback) == len(layers) else f"{len(fallback)} of"
        problems.insert(
            0,
            f"{which} {len(layers)} layers fell back to the pure-torch path "
            f"(cache_kernels is None); the model said: {quoted}",
        )
    if problems:
        if any("source files" in w for w in said):
            fix = (
                f"run `qwen-kvprep fix {_q(directory)}`: it puts the kernel sources beside the "
                "modules-cache copy of modeling_qwen.py, where the model looks for them"
            )
        else:
            fix = f"run `qwen-kvprep doctor {_q(directory)}` to see why the extension is not used"
        return fail(
            "smoke.kernel",
            "the KV-cache kernel is not used: " + "; ".join(problems[:4]),
            fix=fix,
            paths=[directory],
            fallback_layers=fallback,
            problems=problems,
            warnings=said,
        )
    files = sorted({str((row.get("kernel") or {}).get("file")) for row in layers})
    calls = sum(int(row.get("kernel_calls") or 0) for row in layers)
    return ok(
        "smoke.kernel",
        f"the compiled extension ran in all {len(layers)} layers ({calls} calls)",
        paths=files,
        calls=calls,
    )


def _fast_path(result: SmokeResult, directory: str) -> Finding:
    """Whether every layer ran the quantized cache through qwen-kvprep's fast path."""
    layers = result.get("layers") or []
    if not layers or not all(row.get("use_cache_quantization") for row in layers):
        return skip("smoke.fast_path", "not checked: the quantized cache is off")
    if not any(row.get("fast_path_installed") for row in layers):
        return info(
            "smoke.fast_path",
            "the model runs its own quantized-cache code (modeling_qwen.py does not import "
            "qwen-kvprep's fast path)",
        )
    slow = [row["name"] for row in layers if not row.get("fast_steps")]
    if slow:
        return fail(
            "smoke.fast_path",
            f"the fast path is installed but {len(slow)} of {len(layers)} layers did not run "
            f"it ({', '.join(slow[:3])}{', ...' if len(slow) > 3 else ''}): the extension "
            "loaded is not one built from qwen-kvprep's kernel sources of this version",
            fix=f"run `qwen-kvprep fix {_q(directory)} --source vendored`, or "
            f"`qwen-kvprep fix {_q(directory)} --no-fast-path` to keep Qwen's kernels",
            paths=[directory],
            slow_layers=slow,
        )
    own = result.get("own_code")
    if own is not None:
        problem = _own_code(own, directory)
        if problem is not None:
            return problem
        # the same numbers, in the tests; a difference too small to change a token is said
        worst = own["comparison"]["max_abs_logit_diff"]
        compared = (
            f"; the same {own['comparison']['tokens']} greedy tokens as the model's own Int8 "
            "code, " + (f"logits within {worst:.3g}" if worst else "logits bit for bit")
        )
    elif result.get("per_token_prefill"):
        compared = (
            "; not compared with the model's own Int8 code: --per-token-prefill quantizes "
            "prompts with other numbers by design"
        )
    else:
        compared = ""
    steps = sum(int(row.get("fast_steps") or 0) for row in layers)
    return ok(
        "smoke.fast_path",
        f"the quantized cache ran through qwen-kvprep's fast path in all {len(layers)} layers "
        f"({steps} attention steps, no per-step copy of the cache){compared}",
        steps=steps,
    )


def _own_code(own: OwnCode, directory: str) -> Optional[Finding]:
    """A failure when the fast path's run and the model's own Int8 code's differ, or when
    the fast path could not be set aside to compare them."""
    if own["fast_steps"]:
        return fail(
            "smoke.fast_path",
            f"the fast path could not be set aside to run the model's own Int8 code "
            f"({own['fast_steps']} attention steps still went through it), so nothing shows "
            "that it gives this model's numbers: qwen_kvprep_kv.py is not the one this "
            "qwen-kvprep writes",
            fix=f"run `qwen-kvprep fix {_q(directory)}`",
            paths=[directory],
            own_code=own,
        )
    comparison = own["comparison"]
    diverged = comparison["first_divergence"]
    if diverged is None:
        return None
    return fail(
        "smoke.fast_path",
        f"the fast path does not reproduce this model's own Int8 code: their greedy tokens "
        f"differ from token {diverged + 1} of {comparison['tokens']} on (the fast path stands "
        "in only for attention code it reproduces exactly)",
        fix=f"run `qwen-kvprep fix {_q(directory)}`: it takes the fast path out of code it does "
        f"not reproduce (or `qwen-kvprep fix {_q(directory)} --no-fast-path`)",
        paths=[directory],
        own_code=own,
    )


# Quantized linear layers per transformer block in Qwen's Int4 checkpoints: attn.c_attn,
# attn.c_proj, mlp.w1, mlp.w2, mlp.c_proj.
GPTQ_LINEARS_PER_BLOCK = 5


def _gptq(g: GptqModules, directory: str) -> Finding:
    """smoke.gptq: every block linear of a GPTQ checkpoint ran through the GPTQ backend."""
    blocks, modules, called = g["blocks"], g["modules"], g["called"]
    expected = GPTQ_LINEARS_PER_BLOCK * blocks
    classes = ", ".join(f"{n} x{c}" for n, c in sorted(g["classes"].items())) or "none"
    problems = []
    if modules < expected:
        problems.append(
            f"{modules} modules hold GPTQ-packed weights where {blocks} blocks need {expected}"
        )
    if g["plain_linears"]:
        problems.append(
            f"{len(g['plain_linears'])} linear layers inside the blocks are plain nn.Linear "
            f"({', '.join(g['plain_linears'][:3])}{', ...' if len(g['plain_linears']) > 3 else ''})"
        )
    if called < modules:
        problems.append(f"only {called} of {modules} quantized linear modules ran")
    details: dict[str, object] = {**g, "expected": expected}
    if problems:
        return fail(
            "smoke.gptq",
            "the GPTQ checkpoint's linear layers do not all run through the GPTQ backend: "
            + "; ".join(problems),
            fix=f"run `qwen-kvprep doctor {_q(directory)} --check env.gptq` and install what "
            "it names",
            paths=[directory],
            details=details,
        )
    return ok(
        "smoke.gptq",
        f"all {modules} linear layers of the {blocks} blocks ran through the GPTQ backend "
        f"({g['calls']} calls; {classes})",
        details=details,
    )


def _agreement(result: SmokeResult, directory: str) -> tuple[Finding, Agreement]:
    """The finding, and its details for the summary."""
    q = result.get("quantized") or {}
    if not q.get("enabled"):
        return skip("smoke.agreement", "not compared: the quantized cache is off"), {}
    cmp_ = result.get("comparison") or {}
    first = result.get("first_step") or {}
    n = int(cmp_.get("tokens") or 0)
    same = int(cmp_.get("identical_tokens") or 0)
    div = cmp_.get("first_divergence")
    rel = float(cmp_.get("max_rel_logit_diff") or 0.0)
    span = float(first.get("logit_range") or 0.0)
    first_rel = (float(first.get("max_abs_logit_diff") or 0.0) / span) if span > 0 else 0.0
    details: Agreement = {
        "tokens": n,
        "identical_tokens": same,
        "fraction": (same / n) if n else None,
        "first_divergence": div,
        "first_step_max_abs_logit_diff": first.get("max_abs_logit_diff"),
        "first_step_logit_range": first.get("logit_range"),
        "first_step_rel_logit_diff": first_rel,
        "max_rel_logit_diff": rel,
        "divergence_rel_margin": cmp_.get("divergence_rel_margin"),
        "threshold_rel_logit_diff": MAX_REL_LOGIT_DIFF,
    }
    logit_text = (
        f"first-step logits differ by at most {first.get('max_abs_logit_diff', 0):.3g} "
        f"({first_rel:.1%} of their range)"
    )
    problems = []
    if rel > MAX_REL_LOGIT_DIFF:
        problems.append(
            f"logits differ by up to {rel:.1%} of their range on the shared prefix "
            f"(allowed {MAX_REL_LOGIT_DIFF:.0%})"
        )
    margin = cmp_.get("divergence_rel_margin")
    if div is not None and (margin is None or margin > MAX_REL_LOGIT_DIFF):
        problems.append(
            f"generations part at token {div + 1} where the unquantized model preferred "
            f"its token by {margin:.1%} of the logit range (not a near-tie)"
            if margin is not None
            else f"generations part at token {div + 1}"
        )
    fix = (
        "the kernel computes something else than the format it is given: rebuild it with "
        f"`qwen-kvprep fix {_q(directory)}` and report the numbers in details"
    )
    if problems:
        return fail(
            "smoke.agreement",
            f"quantized and unquantized generations disagree: {'; '.join(problems)}; "
            f"{same}/{n} identical tokens",
            fix=fix,
            paths=[directory],
            **details,
        ), details
    if div is None:
        text = f"quantized and unquantized generations agree on {same}/{n} tokens; {logit_text}"
    else:
        text = (
            f"generations agree on the first {div}/{n} tokens, then part at a near-tie "
            f"(margin {margin:.1%} of the logit range); {logit_text}"
        )
    return ok("smoke.agreement", text, **details), details


def _num(n: float) -> str:
    return f"{n:,.0f}" if float(n).is_integer() else f"{n:,.1f}"


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _first_layer(cache: CacheSummary) -> Optional[CacheLayer]:
    layers = cache.get("layers") or []
    return layers[0] if layers else None


def measurements(result: SmokeResult) -> SmokeNumbers:
    """The numbers of the summary object: bytes per token, speed, memory, times."""
    q = result.get("quantized") or {}
    u = result.get("unquantized") or {}
    qc, uc = q.get("cache") or {}, u.get("cache") or {}
    q_bpt, u_bpt = qc.get("bytes_per_token"), uc.get("bytes_per_token")
    kv: KvBytes = {
        "quantized": q_bpt if q.get("enabled") else None,
        "unquantized": u_bpt,
        "ratio": (q_bpt / u_bpt) if q.get("enabled") and q_bpt and u_bpt else None,
        "expected_ratio": None,
    }
    ql, ul = _first_layer(qc), _first_layer(uc)
    head_dim = ql.get("head_dim") if ql is not None else None
    if (
        ql is not None
        and ul is not None
        and ql.get("layout") == "quantized"
        and ul.get("layout") == "plain"
        and head_dim
    ):
        kv["head_dim"] = head_dim
        kv["heads"] = ql.get("heads")
        kv["layers"] = len(qc.get("layers") or [])
        kv["scale_bytes"] = ql.get("scale_bytes")
        kv["element_bytes"] = ul.get("element_bytes")
        kv["expected_ratio"] = expected_ratio(
            int(head_dim), int(ql["scale_bytes"]), int(ul["element_bytes"])
        )
    # with the quantized cache off, the "quantized" run ran the unquantized cache: nothing
    # of it is a quantized figure
    on = bool(q.get("enabled"))
    return {
        "kv_bytes_per_token": kv,
        "tokens_per_s": {
            "quantized": q.get("decode_tokens_per_s") if on else None,
            "unquantized": u.get("decode_tokens_per_s"),
        },
        "prefill_seconds": {
            "quantized": q.get("prefill_seconds") if on else None,
            "unquantized": u.get("prefill_seconds"),
        },
        "load_seconds": result.get("load_seconds"),
        "peak_memory": result.get("peak_memory"),
        # per run (the allocator's peak is reset before each): CUDA only, RSS never drops
        "peak_memory_by_run": {
            "quantized": (q.get("peak_memory") or {}).get("bytes") if on else None,
            "unquantized": (u.get("peak_memory") or {}).get("bytes"),
        }
        if (result.get("peak_memory") or {}).get("kind") == "cuda_max_allocated"
        else None,
    }


def _measure(m: SmokeNumbers, result: SmokeResult) -> Finding:
    kv = m["kv_bytes_per_token"]
    parts = []
    if kv["quantized"] is not None and kv["unquantized"]:
        parts.append(
            f"KV cache per token {_num(kv['quantized'])} bytes instead of "
            f"{_num(kv['unquantized'])} ({kv['ratio']:.3f}x)"
        )
    elif kv["unquantized"]:
        parts.append(f"KV cache per token {_num(kv['unquantized'])} bytes (unquantized)")
    parts.append(f"load {m['load_seconds']:.1f} s")
    tps = m["tokens_per_s"]
    if tps["quantized"] and tps["unquantized"]:
        parts.append(
            f"{tps['quantized']:.0f} tokens/s quantized, {tps['unquantized']:.0f} unquantized"
        )
    elif tps["unquantized"]:
        parts.append(f"{tps['unquantized']:.0f} tokens/s unquantized")
    if kv["quantized"] is None:
        parts.append("nothing quantized was measured: the quantized cache is off")
    peak = m.get("peak_memory")
    if peak is not None and peak.get("bytes"):
        what = "GPU peak" if peak.get("kind") == "cuda_max_allocated" else "peak RSS"
        parts.append(f"{what} {_bytes(int(peak['bytes']))}")
    text = f"on {result.get('device_name', result.get('device'))}: " + "; ".join(parts)
    ratio, exp = kv.get("ratio"), kv.get("expected_ratio")
    if ratio is not None and exp is not None and abs(ratio - exp) > 1e-6:
        return warn(
            "smoke.measure",
            text + f"; the format predicts {exp:.3f}x: the cache holds more than the format",
            **m,
        )
    return info("smoke.measure", text, **m)


def evaluate(
    outcome: SmokeOutcome, options: SmokeOptions, directory: str
) -> tuple[list[Finding], SmokeSummary]:
    """Findings (ids smoke.load, smoke.run, smoke.numbers, smoke.quantization, smoke.kernel,
    smoke.gptq for GPTQ checkpoints, smoke.agreement, smoke.measure, smoke.kv_score where
    the Int8 cache is on) and the summary object for --json and the state."""
    summary: SmokeSummary = {
        "ok": False,
        "device_requested": options.device,
        "timeout_s": options.timeout,
        "timed_out": outcome.timed_out,
        "elapsed_seconds": round(outcome.elapsed, 3),
    }
    result = outcome.result
    if result is None:
        finding = _failure(outcome, options, directory)
        summary["phase"] = _failed_phase(outcome)
        summary["error"] = finding.message.split("\n", 1)[0]
        return [finding], summary

    agreement_finding, agreement = _agreement(result, directory)
    findings = [
        ok(
            "smoke.load",
            f"loaded as a server would (from_pretrained, trust_remote_code) on "
            f"{result.get('device')} in {float(result.get('load_seconds') or 0):.1f} s",
            paths=[p for p in [result.get("model_code")] if p],
            transformers=result.get("transformers"),
            torch=result.get("torch"),
        ),
        _numbers(result, directory),
        _quantization(result, directory),
        _kernel(result, outcome.log_tail, directory),
        _fast_path(result, directory),
        agreement_finding,
    ]
    gptq = result.get("gptq")
    if gptq is not None:
        findings.insert(4, _gptq(gptq, directory))
    m = measurements(result)
    findings.append(_measure(m, result))
    layers = result.get("layers") or []
    summary.update({"gptq": gptq} if gptq is not None else {})
    passage = result.get("kv_passage")
    if passage is not None:
        scored, row = judge_passage(passage)
        findings.append(scored)
        summary["kv_cache"] = [row]
    return findings, {
        **summary,
        "ok": not any(f.severity is Severity.FAIL for f in findings),
        "device": result.get("device"),
        "device_name": result.get("device_name"),
        "torch": result.get("torch"),
        "torch_cuda": result.get("torch_cuda"),
        "transformers": result.get("transformers"),
        "model_dtype": result.get("model_dtype"),
        "cpu_threads": result.get("cpu_threads"),
        "model_code": result.get("model_code"),
        "layers": len(layers),
        "kernel_layers": sum(
            1
            for row in layers
            if (row.get("kernel") or {}).get("compiled") and row.get("kernel_calls")
        ),
        "kernel_calls": sum(int(row.get("kernel_calls") or 0) for row in layers),
        "fast_layers": sum(1 for row in layers if row.get("fast_steps")),
        "kernel_files": sorted(
            {str(row["kernel"]["file"]) for row in layers if (row.get("kernel") or {}).get("file")}
        ),
        "prompt": result.get("prompt"),
        "prompt_tokens": result.get("prompt_tokens"),
        "max_new_tokens": result.get("max_new_tokens"),
        "agreement": agreement,
        "text": {
            "quantized": (result.get("quantized") or {}).get("text"),
            "unquantized": (result.get("unquantized") or {}).get("text"),
        },
        **m,
    }

