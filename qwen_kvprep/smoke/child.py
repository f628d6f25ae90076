"""Child side of `qwen-kvprep smoke`: `python -m qwen_kvprep.smoke.child DIR --fd N ...`.

It runs in its own process so that whatever the model code does (crash in a CUDA kernel,
hang in a JIT build lock, call os._exit) cannot take the CLI with it. It only measures;
the parent judges the numbers (qwen_kvprep.smoke.evaluate), so thresholds can be changed
and tested without loading a model.

The model is loaded as a server would load it: `from_pretrained(DIR,
trust_remote_code=True)` with nothing overriding the config, so the flags in config.json
are what is tested. Generation is a hand-written greedy loop over the model's own forward
(the same calls `generate` makes for greedy search) rather than `generate` itself: the
checkpoint's generation_config.json asks for sampling, stop words and a repetition
penalty, and transformers versions differ in how they merge a caller's config with it; a
loop of plain forwards gives exactly N tokens and raw logits on every version.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import TYPE_CHECKING, Callable, Optional, TypedDict

from qwen_kvprep.childproc import Events, child_main, exit_child
from qwen_kvprep.common import FAST_FILE
from qwen_kvprep.runtime import (
    COMPAT_MARK,
    FAST_MARK,
    FAST_OFF,
    FAST_STEPS,
    FLAG,
    KERNELS,
    CallCounter,
    CountingKernels,
    attention_layers,
    captured_warnings,
    gptq_linears,
    input_device,
    is_gptq_model,
    kernel_info,
    moved_to_gpu,
    plain_block_linears,
    pretrained_model,
    pretrained_tokenizer,
    resolve_device,
    restore,
    set_cache_quantization,
)
from qwen_kvprep.runtime import has_accelerate as _has_accelerate
from qwen_kvprep.runtime import legacy_cache as _legacy
from qwen_kvprep.runtime import rss_peak_bytes as _rss_peak_bytes
from qwen_kvprep.runtime import tensors_in as _tensors
from qwen_kvprep.smoke.kvscore import measure_passage
from qwen_kvprep.smoke.numbers import loaded_numbers
from qwen_kvprep.smoke.protocol import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_PROMPT,
    DEVICES,
    PHASE_INSPECT,
    PHASE_KV_PASSAGE,
    PHASE_LOAD,
    PHASE_OWN_CODE,
    PHASE_QUANTIZED,
    PHASE_UNQUANTIZED,
    PHASE_WARMUP,
    RESULT_VERSION,
    CacheLayer,
    CacheSummary,
    Comparison,
    FirstStep,
    GptqModules,
    KvPassage,
    LayerRow,
    ModeRun,
    OwnCode,
    PeakMemory,
    SmokeResult,
)

if TYPE_CHECKING:
    import torch
    from transformers.modeling_utils import PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from qwen_kvprep.runtime import LayerCache, LegacyCache, ModelOutput

# Logits are compared only while both runs share a prefix, i.e. up to the first
# divergence; keeping more steps than this costs memory (vocab x 4 bytes each) for nothing.
KEEP_LOGITS_STEPS = 64
WARMUP_TOKENS = 3


def load_model(
    directory: str, device: str
) -> tuple[PreTrainedTokenizerBase, PreTrainedModel, float, list[str]]:
    """Tokenizer and model as a server loads them; also the warnings printed meanwhile."""
    with captured_warnings() as messages:
        t0 = time.perf_counter()
        tokenizer = pretrained_tokenizer(directory)
        kwargs: dict[str, str] = {}
        if device == "cuda" and _has_accelerate():
            kwargs["device_map"] = "auto"  # what Qwen's own instructions use
        model = pretrained_model(directory, **kwargs)
        if device == "cuda" and "device_map" not in kwargs:
            model = moved_to_gpu(model)
        model.eval()  # type: ignore[no-untyped-call, unused-ignore]
        if device == "cuda":
            import torch

            torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
    return tokenizer, model, load_s, messages


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def cache_layout(layer_past: LayerCache, batch: int, tokens: int) -> CacheLayer:
    """Describe one layer's cache entry: quantized ((q, scale, zero), (q, scale, zero))
    with q [b, h, s, d] uint8 and scale/zero [b, h, s, 1], or plain (key, value)."""
    import torch

    # numel * element_size, not storage size: key/value may be views of one projection
    # output, but what a cache holds per token is their logical size
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(layer_past))
    parts = list(layer_past) if isinstance(layer_past, (tuple, list)) else []
    triples = [p for p in parts if isinstance(p, (tuple, list)) and len(p) == 3]
    if len(parts) == 2 and len(triples) == 2:
        q, scale, zero = triples[0]
        vq, vscale, vzero = triples[1]
        heads, head_dim = (q.shape[1], q.shape[3]) if q.dim() == 4 else (None, None)
        want_q = [batch, heads, tokens, head_dim]
        want_s = [batch, heads, tokens, 1]
        return {
            "bytes": nbytes,
            "layout": "quantized",
            "q_dtype": _dtype_name(q),
            "v_dtype": _dtype_name(vq),
            "q_shape": list(q.shape),
            "scale_shape": list(scale.shape),
            "zero_shape": list(zero.shape),
            "scale_dtype": _dtype_name(scale),
            "scale_bytes": scale.element_size(),
            "heads": heads,
            "head_dim": head_dim,
            "per_token": (
                all(list(t.shape) == want_s for t in (scale, zero, vscale, vzero))
                and list(q.shape) == want_q
                and list(vq.shape) == want_q
            ),
        }
    plain = [p for p in parts if isinstance(p, torch.Tensor)]
    if len(parts) == 2 and len(plain) == 2:
        return {
            "bytes": nbytes,
            "layout": "plain",
            "dtype": _dtype_name(plain[0]),
            "shape": list(plain[0].shape),
            "element_bytes": plain[0].element_size(),
        }
    return {"bytes": nbytes, "layout": "unknown"}


class Generated(TypedDict):
    """A greedy run as `greedy` returns it: with the logits `compare_runs` needs."""

    tokens: list[int]
    step_logits: list[torch.Tensor]
    prefill_seconds: float
    decode_seconds: float
    decode_tokens_per_s: Optional[float]


class Measured(Generated):
    """A greedy run with its cache and its memory peak."""

    cache: CacheSummary
    peak_memory: PeakMemory


def greedy(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    new_tokens: int,
    on_prefill: Callable[[LegacyCache], None],
    device: str,
) -> Generated:
    """N greedy tokens through the model's forward with its cache; raw first-step logits."""
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        out: ModelOutput = model(input_ids=input_ids, use_cache=True)
        logits = out.logits[:, -1, :].float()
        token = logits.argmax(dim=-1)
        step_logits = [logits[0].cpu()]
        tokens = [int(token[0])]  # int() synchronises, so the timing below is honest
        t1 = time.perf_counter()
        on_prefill(_legacy(out.past_key_values))
        past = out.past_key_values
        t2 = time.perf_counter()
        steps: list[float] = []
        for _ in range(new_tokens - 1):
            ts = time.perf_counter()
            out = model(input_ids=token[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :]
            token = logits.argmax(dim=-1)
            tokens.append(int(token[0]))  # synchronises: the step time is real
            steps.append(time.perf_counter() - ts)
            if len(step_logits) < KEEP_LOGITS_STEPS:
                step_logits.append(logits[0].float().cpu())
        sync()
        t3 = time.perf_counter()
    # tokens/s from the median step: one preempted step on a busy machine must not
    # decide the figure
    median = statistics.median(steps) if steps else 0.0
    return {
        "tokens": tokens,
        "step_logits": step_logits,
        "prefill_seconds": t1 - t0,
        "decode_seconds": t3 - t2,
        "decode_tokens_per_s": (1.0 / median) if median > 0 else None,
    }


def _cache_summary(past: LegacyCache, batch: int, tokens: int) -> CacheSummary:
    layers = [cache_layout(lp, batch, tokens) for lp in past]
    total = sum(layer["bytes"] for layer in layers)
    return {"layers": layers, "bytes_per_token": total / (batch * tokens)}


def _peak(device: str) -> PeakMemory:
    if device == "cuda":
        import torch

        return {"kind": "cuda_max_allocated", "bytes": int(torch.cuda.max_memory_allocated())}
    return {"kind": "rss_high_water", "bytes": _rss_peak_bytes()}


def _reset_peak(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def run_mode(
    model: PreTrainedModel, input_ids: torch.Tensor, new_tokens: int, device: str, quantized: bool
) -> Measured:
    """One greedy run with every flagged module's quantization flag set to `quantized`."""
    saved = set_cache_quantization(model, quantized)
    caches: list[CacheSummary] = []  # the cache after the prompt: greedy reports it once
    batch, tokens = int(input_ids.shape[0]), int(input_ids.shape[1])
    _reset_peak(device)
    try:
        run = greedy(
            model,
            input_ids,
            new_tokens,
            lambda past: caches.append(_cache_summary(past, batch, tokens)),
            device,
        )
    finally:
        restore(saved)
    return {**run, "cache": caches[0], "peak_memory": _peak(device)}


def compare_runs(q: Generated, u: Generated) -> tuple[FirstStep, Comparison]:
    """Logit differences while the two runs still share a prefix (before the first
    different token, and at it), and how close a call the first divergence was."""
    qt, ut = q["tokens"], u["tokens"]
    ql, ul = q["step_logits"], u["step_logits"]
    diverged = next((i for i, (a, b) in enumerate(zip(qt, ut)) if a != b), None)
    last = diverged if diverged is not None else len(ut) - 1
    worst_abs = worst_rel = 0.0
    steps = min(last + 1, len(ql), len(ul))
    for j in range(steps):
        ref = ul[j]
        diff = float((ql[j] - ref).abs().max())
        span = float(ref.max() - ref.min())
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / span if span > 0 else 0.0)
    ref0 = ul[0]
    first: FirstStep = {
        "max_abs_logit_diff": float((ql[0] - ref0).abs().max()),
        "logit_range": float(ref0.max() - ref0.min()),
        "argmax_quantized": int(ql[0].argmax()),
        "argmax_unquantized": int(ref0.argmax()),
    }
    comparison: Comparison = {
        "tokens": len(ut),
        "identical_tokens": sum(a == b for a, b in zip(qt, ut)),
        "first_divergence": diverged,
        "steps_compared": steps,
        "max_abs_logit_diff": worst_abs,
        "max_rel_logit_diff": worst_rel,
        "divergence_margin": None,
        "divergence_rel_margin": None,
    }
    if diverged is not None and diverged < len(ul):
        ref = ul[diverged]
        # how much the unquantized model preferred its own token over the quantized
        # run's pick, on the same prefix: a small margin is a near-tie, not a bug
        margin = float(ref[ut[diverged]] - ref[qt[diverged]])
        span = float(ref.max() - ref.min())
        comparison["divergence_margin"] = margin
        comparison["divergence_rel_margin"] = margin / span if span > 0 else None
    return first, comparison


def own_code(
    model: PreTrainedModel,
    layers: list[tuple[str, torch.nn.Module]],
    input_ids: torch.Tensor,
    fast: Generated,
    device: str,
) -> OwnCode:
    """The fast path's greedy run again with the fast path set aside in every layer (its
    off switch: the model's own Int8 code runs), compared with it."""
    saved = set_cache_quantization(model, True)
    for _, mod in layers:
        setattr(mod, FAST_OFF, True)
        setattr(mod, FAST_STEPS, 0)
    try:
        run = greedy(model, input_ids, len(fast["tokens"]), lambda past: None, device)
        fast_steps = sum(int(getattr(mod, FAST_STEPS, 0) or 0) for _, mod in layers)
    finally:
        for _, mod in layers:
            setattr(mod, FAST_OFF, False)
        restore(saved)
    _, comparison = compare_runs(fast, run)
    return {"tokens": run["tokens"], "fast_steps": fast_steps, "comparison": comparison}


def per_token_prefill(layers: list[tuple[str, torch.nn.Module]]) -> bool:
    """Whether the fast path beside the model's code quantizes prompts per token (fix
    --per-token-prefill): other numbers than the model's own, by design."""
    package = type(layers[0][1]).__module__.rpartition(".")[0] if layers else ""
    module = sys.modules.get(f"{package}.{FAST_FILE[: -len('.py')]}")
    return bool(getattr(module, "PER_TOKEN_PREFILL", False))


def smoke(
    directory: str, device_req: str, prompt: str, new_tokens: int, ev: Events
) -> SmokeResult:
    import torch
    import transformers

    device = resolve_device(device_req)
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    cpu_threads = torch.get_num_threads()

    ev.start(PHASE_LOAD)
    tokenizer, model, load_s, messages = load_model(directory, device)
    model_dtype = _dtype_name(next(model.parameters()))
    code = sys.modules.get(type(model).__module__)
    peak_after_load = _peak(device)

    ev.start(PHASE_INSPECT)
    numbers = loaded_numbers(model, directory)
    layers = attention_layers(model)
    layer_rows: list[LayerRow] = []
    proxies: list[Optional[CountingKernels]] = []
    for name, mod in layers:
        row: LayerRow = {
            "name": name,
            "use_cache_quantization": bool(getattr(mod, FLAG, False)),
            "use_cache_kernel": bool(getattr(mod, "use_cache_kernel", False)),
            "kernel": kernel_info(mod),
            "kernel_calls": 0,  # counted in the quantized run below
            "fast_path_installed": bool(getattr(type(mod), FAST_MARK, False)),
            "fast_steps": 0,
        }
        setattr(mod, FAST_STEPS, 0)
        layer_rows.append(row)
        if getattr(mod, KERNELS, None) is not None:
            proxy = CountingKernels(getattr(mod, KERNELS))
            setattr(mod, KERNELS, proxy)
            proxies.append(proxy)
        else:
            proxies.append(None)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError(f"the tokenizer turned the prompt {prompt!r} into no tokens")
    input_ids = torch.tensor([ids], dtype=torch.long, device=input_device(model))

    quantized_on = any(r["use_cache_quantization"] for r in layer_rows)
    ev.start(PHASE_WARMUP)
    # A few untimed tokens in each mode first: the first calls pay one-time costs (kernel
    # and allocator set-up) that would otherwise be charged to whichever mode runs first.
    for mode in (quantized_on, False):
        run_mode(model, input_ids, min(WARMUP_TOKENS, new_tokens), device, quantized=mode)
    for counter in proxies:
        if counter is not None:
            counter.calls = 0
    gptq = is_gptq_model(model)
    quant_linears = gptq_linears(model)
    linear_calls = CallCounter(quant_linears) if gptq else None
    ev.start(PHASE_QUANTIZED)
    # The model as configured first: with the patched config this is the quantized cache.
    try:
        q = run_mode(model, input_ids, new_tokens, device, quantized=quantized_on)
    finally:
        if linear_calls is not None:
            linear_calls.remove()
    for row, (_, mod), counter in zip(layer_rows, layers, proxies):
        row["kernel_calls"] = counter.calls if counter is not None else 0
        row["fast_steps"] = int(getattr(mod, FAST_STEPS, 0) or 0)
        if counter is not None:
            setattr(mod, KERNELS, counter._inner)  # the model as it was
    # The fast path stands in for the model's own Int8 code: where it ran, that code runs
    # the same generation, and the tokens must be the same.
    own: Optional[OwnCode] = None
    per_token = per_token_prefill(layers)
    if quantized_on and any(row["fast_steps"] for row in layer_rows) and not per_token:
        ev.start(PHASE_OWN_CODE)
        own = own_code(model, layers, input_ids, q, device)
    ev.start(PHASE_UNQUANTIZED)
    u = run_mode(model, input_ids, new_tokens, device, quantized=False)
    # the Int8 cache judged as the engine smoke judges vLLM's caches (kvjudge)
    passage: Optional[KvPassage] = None
    if quantized_on:
        ev.start(PHASE_KV_PASSAGE)
        passage = measure_passage(model, tokenizer)

    first_step, comparison = compare_runs(q, u)
    result: SmokeResult = {
        "result_version": RESULT_VERSION,
        "device": device,
        "device_name": device_name,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cpu_threads": cpu_threads,
        "prompt": prompt,
        "max_new_tokens": new_tokens,
        "load_seconds": load_s,
        "load_warnings": messages,
        "model_dtype": model_dtype,
        "model_code": getattr(code, "__file__", None),
        "compat": [str(n) for n in getattr(type(model), COMPAT_MARK, None) or ()],
        "numbers": numbers,
        "peak_after_load": peak_after_load,
        "layers": layer_rows,
        "prompt_tokens": len(ids),
        "first_step": first_step,
        "comparison": comparison,
        "quantized": {**_sent(q, tokenizer), "enabled": quantized_on},
        "unquantized": _sent(u, tokenizer),
        "peak_memory": _peak(device) if device != "cuda" else {
            "kind": "cuda_max_allocated",
            "bytes": max(q["peak_memory"]["bytes"], u["peak_memory"]["bytes"],
                         peak_after_load["bytes"]),
        },
    }
    if linear_calls is not None:
        result["gptq"] = _gptq_modules(model, quant_linears, linear_calls, len(layers))
    if own is not None:
        result["own_code"] = own
    if per_token:
        result["per_token_prefill"] = True
    if passage is not None:
        result["kv_passage"] = passage
    return result


def _gptq_modules(
    model: torch.nn.Module,
    quant_linears: list[tuple[str, torch.nn.Module]],
    counter: CallCounter,
    blocks: int,
) -> GptqModules:
    """Which modules computed the linear layers of a GPTQ model, and whether they ran."""
    classes: dict[str, int] = {}
    for _, mod in quant_linears:
        key = f"{type(mod).__module__}.{type(mod).__qualname__}"
        classes[key] = classes.get(key, 0) + 1
    return {
        "blocks": blocks,
        "modules": len(quant_linears),
        "classes": classes,
        "called": sum(1 for c in counter.counts.values() if c > 0),
        "calls": sum(counter.counts.values()),
        "plain_linears": plain_block_linears(model),
    }


def _sent(run: Measured, tokenizer: PreTrainedTokenizerBase) -> ModeRun:
    """A run as the result carries it: its text instead of its logits."""
    return {
        "tokens": run["tokens"],
        "prefill_seconds": run["prefill_seconds"],
        "decode_seconds": run["decode_seconds"],
        "decode_tokens_per_s": run["decode_tokens_per_s"],
        "cache": run["cache"],
        "peak_memory": run["peak_memory"],
        "text": str(tokenizer.decode(run["tokens"])),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qwen_kvprep.smoke.child")
    parser.add_argument("directory")
    parser.add_argument("--fd", type=int, default=None, help="descriptor for the events")
    parser.add_argument("--device", choices=DEVICES, default="auto")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    args = parser.parse_args(argv)
    return child_main(
        args.fd,
        lambda ev: smoke(args.directory, args.device, args.prompt, args.max_new_tokens, ev),
    )


if __name__ == "__main__":
    exit_child(main())
