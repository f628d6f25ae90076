"""`plan`'s output: the JSON payload under `plan`, and the text tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, TypedDict

from qwen_kvprep.findings import Finding
from qwen_kvprep.jsontypes import JSONObject
from qwen_kvprep.planning.capacity import PlanResult
from qwen_kvprep.planning.model import ModelFacts
from qwen_kvprep.planning.peak import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    FAST_BLOCK,
    kv_bytes_per_token,
)
from qwen_kvprep.planning.sizes import gib, human
from qwen_kvprep.planning.split import CardLoad

MODE_LABEL = {"unquantized": "unquantized cache", "int8": "Int8 cache"}
SPLIT = 'transformers\' device_map="auto"'


class KvBytesJSON(TypedDict):
    unquantized: int
    int8: int


class CardJSON(TypedDict):
    """One card of `plan --json`'s "cards"."""

    card: int
    budget_bytes: int  # what device_map fills it to: max_memory, balanced
    weights_bytes: int
    layers: int
    first_layer: Optional[int]
    last_layer: Optional[int]
    modules: list[str]  # wte, ln_f, lm_head where they are
    kv_bytes_per_token: KvBytesJSON  # its layers' part


class PlanJSON(TypedDict):
    """The "plan" object of `plan --json`."""

    directory: str
    model: JSONObject  # ModelFacts.to_json
    weights_bytes: int
    weights_source: str
    kv_bytes_per_token: KvBytesJSON
    gpu_memory_bytes: int
    gpu_memory_source: str
    cuda_context_bytes: int
    prompt_tokens: int
    prefill_chunk: Optional[int]
    table: list[JSONObject]  # Row.to_json
    max_batch: dict[str, int]  # per mode, at max_batch_at_tokens
    max_batch_at_tokens: int
    max_tokens: dict[str, int]  # per mode, at max_tokens_at_batch
    max_tokens_at_batch: int
    fast_path: bool  # the Int8 figures are those of qwen-kvprep's fast path
    fast_path_pending: bool  # ... which fix has not installed yet (it will by default)
    gpus: int
    weights_fit: bool  # the weights alone fit the cards
    cards: list[CardJSON]
    offloaded: list[str]  # modules that fit no card (device_map would offload them)
    max_batch_card: dict[str, Optional[int]]  # the card that runs out first past max_batch
    max_tokens_card: dict[str, Optional[int]]
    assumptions: list[str]


def assumptions(facts: ModelFacts, plan: PlanResult) -> list[str]:
    s = plan.scenario
    chunk = "in one forward" if s.prefill_chunk is None else f"in chunks of {s.prefill_chunk}"
    return [
        f"each run: batch rows of a {s.prompt_tokens}-token prompt fed {chunk}, then greedy "
        "decoding one token per step with the cache until `tokens` are cached",
        "peak = CUDA caching-allocator peak (torch.cuda.max_memory_allocated), weights included",
        f"a run fits when peak + {human(CUDA_CONTEXT_BYTES)} (CUDA context and kernel "
        "images, outside the allocator) <= GPU memory; allocator fragmentation is not "
        "modelled",
        f"dtype {facts.dtype} ({facts.dtype_source})",
        f"weights: {facts.weights_source}",
        "unquantized attention: torch's fused scaled_dot_product_attention (no [b, h, q, l] "
        "score tensor); the Int8 cache: the eager path with the compiled kernel, whose "
        "scores and transposed key codes are counted"
        + (", softmax in fp32" if s.softmax_in_fp32 else ""),
        *(
            [
                "the Int8 cache: qwen-kvprep's fast path ("
                + ("not installed yet: fix installs it by default" if s.fast_path_pending
                   else "installed by fix")
                + f"): per layer, buffers of whole blocks of {FAST_BLOCK} tokens appended in "
                "place, grown with a copy while the old ones are alive; fp16 scales and zero "
                "points"
            ]
            if s.fast_path
            else []
        ),
        "logits: lm_head output for every position of a forward in the model's dtype, plus "
        "an fp32 copy of the last position",
        f"cuBLAS workspace {human(CUBLAS_WORKSPACE_BYTES)}; flash-attn off (it cannot take "
        "the quantized cache); no beam search, no sampling buffers",
        *(
            [
                f"{s.gpus} cards: the weights split as {SPLIT} splits them (balanced: "
                "whole decoder blocks in order, wte on the first card, ln_f and lm_head "
                "after the last block); each card holds its blocks' cache, the transients "
                "of the blocks it runs, the head's where lm_head is and the caller's logits "
                "on the first; a run fits when every card's peak does"
            ]
            if s.gpus > 1
            else []
        ),
    ]


def _kv_of(shape_layers: int, card: CardLoad, per_token: int) -> int:
    # every layer's cache is the same size
    return per_token * len(card.layers) // shape_layers


def _kv_per_token(plan: PlanResult) -> KvBytesJSON:
    """The cache bytes of a token, all layers, as the plan's tables count them: the Int8
    figure is the fast path's (fp16 scales) where the plan runs it, so that the header, each
    card's part and the peaks agree (they differ for fp32 models only)."""
    return {
        "unquantized": kv_bytes_per_token(plan.shape, "unquantized"),
        "int8": kv_bytes_per_token(plan.shape, "int8", plan.scenario.fast_path),
    }


def split_json(plan: PlanResult) -> list[CardJSON]:
    shape = plan.shape
    kv = _kv_per_token(plan)
    out: list[CardJSON] = []
    for card in plan.split.cards:
        layers = card.layers
        out.append({
            "card": card.index,
            "budget_bytes": card.budget_bytes,
            "weights_bytes": card.weights_bytes,
            "layers": len(layers),
            "first_layer": layers[0] if layers else None,
            "last_layer": layers[-1] if layers else None,
            "modules": [m.name for m in card.modules if m.layer < 0],
            "kv_bytes_per_token": {
                "unquantized": _kv_of(shape.layers, card, kv["unquantized"]),
                "int8": _kv_of(shape.layers, card, kv["int8"]),
            },
        })
    return out


def payload(facts: ModelFacts, plan: PlanResult, gpu_source: str) -> PlanJSON:
    shape = plan.shape
    return {
        "directory": str(facts.path),
        "model": facts.to_json(),
        "weights_bytes": shape.weights_bytes,
        "weights_source": facts.weights_source,
        "kv_bytes_per_token": _kv_per_token(plan),
        "gpu_memory_bytes": plan.scenario.gpu_memory_bytes,
        "gpu_memory_source": gpu_source,
        "cuda_context_bytes": CUDA_CONTEXT_BYTES,
        "prompt_tokens": plan.scenario.prompt_tokens,
        "prefill_chunk": plan.scenario.prefill_chunk,
        "table": [r.to_json() for r in plan.rows],
        "max_batch": dict(plan.max_batch),
        "max_batch_at_tokens": plan.tokens[0],
        "max_tokens": dict(plan.max_tokens),
        "max_tokens_at_batch": plan.batches[0],
        "fast_path": plan.scenario.fast_path,
        "fast_path_pending": plan.scenario.fast_path_pending,
        "gpus": plan.scenario.gpus,
        "weights_fit": plan.split.holds_weights,
        "cards": split_json(plan),
        "offloaded": [m.name for m in plan.split.offloaded],
        "max_batch_card": dict(plan.max_batch_card),
        "max_tokens_card": dict(plan.max_tokens_card),
        "assumptions": assumptions(facts, plan),
    }


def _table(title: str, head: str, keys: list[int], cells: dict[str, list[str]]) -> list[str]:
    first = max(len(head), *(len(MODE_LABEL[m]) for m in cells))
    widths = [max(len(f"{k:,}"), *(len(cells[m][i]) for m in cells)) for i, k in enumerate(keys)]
    lines = [title, ""]
    lines.append(
        f"| {head:<{first}} | " + " | ".join(f"{k:>{w},}" for k, w in zip(keys, widths)) + " |"
    )
    lines.append(f"|{'-' * (first + 2)}|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for mode, values in cells.items():
        row = " | ".join(f"{v:>{w}}" for v, w in zip(values, widths))
        lines.append(f"| {MODE_LABEL[mode]:<{first}} | {row} |")
    return lines


def _cell(plan: PlanResult, mode: str, batch: int, tokens: int) -> str:
    row = plan.row(batch, tokens)
    return "OOM" if row.oom_of(mode) else gib(row.bytes_of(mode))


def _gain(before: int, after: int) -> str:
    if before == 0:
        return "(nothing fits without it)" if after else "(nothing fits either way)"
    return f"({after / before:.2f}×)"


def _context_note(facts: ModelFacts) -> str:
    limits = []
    if facts.seq_length:
        limits.append(f"seq_length {facts.seq_length:,}")
    if facts.max_position_embeddings:
        limits.append(f"max_position_embeddings {facts.max_position_embeddings:,}")
    return f"; memory only, the config says {' and '.join(limits)}" if limits else ""


def _cards_table(plan: PlanResult) -> list[str]:
    """What each card holds, its weights and its part of the cache per token."""
    shape = plan.shape
    kv = _kv_per_token(plan)
    head = ("card", "holds", "weights (GiB)", "KV cache per token", "with Int8")
    rows = [
        (str(c.index), c.holds(), gib(c.weights_bytes, 2),
         human(_kv_of(shape.layers, c, kv["unquantized"])),
         human(_kv_of(shape.layers, c, kv["int8"])))
        for c in plan.split.cards
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    right = (True, False, True, True, True)

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(
            f"{c:>{w}}" if r else f"{c:<{w}}" for c, w, r in zip(cells, widths, right)) + " |"

    rule = "|" + "|".join(
        "-" * (w + 1) + ":" if r else "-" * (w + 2) for w, r in zip(widths, right)) + "|"
    return [
        f"Cards: the weights split as {SPLIT} splits them (whole blocks, balanced)",
        "",
        line(head),
        rule,
        *(line(r) for r in rows),
        "",
    ]


def _runs_out(cards: dict[str, Optional[int]]) -> str:
    """"; card 1 runs out first" (or which card for each cache) with several cards."""
    found = {m: c for m, c in cards.items() if c is not None}
    if not found:
        return ""
    if len(set(found.values())) == 1:
        return f"; card {next(iter(found.values()))} runs out first"
    return "; first to run out: " + ", ".join(
        f"card {c} {'unquantized' if m == 'unquantized' else 'with Int8'}"
        for m, c in found.items())


def _findings_lines(findings: Sequence[Finding]) -> list[str]:
    lines = []
    for f in findings:
        lines.append(f"{f.severity.value}: {f.message} ({f.id})")
        if f.fix:
            lines.append(f"  fix: {f.fix}")
    return [*lines, ""] if lines else []


def render_text(
    facts: ModelFacts, plan: PlanResult, gpu_source: str, shown: Optional[str] = None,
    findings: Sequence[Finding] = (),
) -> str:
    """The text output; `shown` is the directory as the user wrote it."""
    shape, s = plan.shape, plan.scenario
    kv = _kv_per_token(plan)  # the figures the tables use
    kv_u, kv_q = kv["unquantized"], kv["int8"]
    gptq = "" if facts.gptq is None else f", GPTQ {facts.gptq.bits}-bit"
    chunk = "in one forward" if s.prefill_chunk is None else f"in chunks of {s.prefill_chunk}"
    lines = [
        f"model      {shown or facts.path}: {shape.layers} layers, {shape.heads} heads × "
        f"{shape.head_dim}, hidden {shape.hidden}, vocab {shape.vocab:,}, "
        f"{facts.dtype}{gptq}",
        f"weights    {gib(shape.weights_bytes, 2)} GiB ({facts.weights_source})",
        f"KV cache   {human(kv_u)} per token unquantized, {human(kv_q)} with Int8 "
        f"({kv_q / kv_u:.3f}×)"
        + (
            f"; Int8 through qwen-kvprep's fast path (buffers of whole {FAST_BLOCK}-token "
            "blocks)"
            if s.fast_path
            else ""
        )
        + (
            ", which fix installs by default (not yet here; `fix --no-fast-path`: "
            f"{human(kv_bytes_per_token(shape, 'int8'))} per token with Int8)"
            if s.fast_path and s.fast_path_pending
            else ""
        ),
        (
            f"GPU        {gib(s.gpu_memory_bytes, 2)} GiB ({gpu_source}); a run fits when its "
            f"peak + {gib(CUDA_CONTEXT_BYTES)} GiB of CUDA context is within it"
            if s.gpus == 1
            else f"GPUs       {s.gpus} × {gib(s.gpu_memory_bytes, 2)} GiB ({gpu_source}); a run "
            f"fits when each card's peak + {gib(CUDA_CONTEXT_BYTES)} GiB of CUDA context is "
            "within it"
        ),
        f"each run   {s.prompt_tokens}-token prompt {chunk}, then greedy decoding until "
        "the token count is cached; peak = CUDA allocator peak",
        "",
    ]
    lines += _findings_lines(findings)
    several = s.gpus > 1
    if several:
        lines += _cards_table(plan)
    what = "Peak GPU memory of the fullest card (GiB)" if several else "Peak GPU memory (GiB)"
    t0, b0 = plan.tokens[0], plan.batches[0]
    modes = ("unquantized", "int8")
    lines += _table(
        f"{what} by batch, {t0:,} tokens cached",
        "batch",
        list(plan.batches),
        {m: [_cell(plan, m, b, t0) for b in plan.batches] for m in modes},
    )
    lines.append("")
    lines += _table(
        f"{what} by tokens cached, batch {b0:,}",
        "tokens",
        list(plan.tokens),
        {m: [_cell(plan, m, b0, t) for t in plan.tokens] for m in modes},
    )
    mb, mt = plan.max_batch, plan.max_tokens
    lines += [
        "",
        f"Largest batch at {t0:,} tokens: {mb['unquantized']:,} unquantized, "
        f"{mb['int8']:,} with the Int8 cache {_gain(mb['unquantized'], mb['int8'])}"
        f"{_runs_out(plan.max_batch_card) if several else ''}.",
        f"Longest context at batch {b0:,}: {mt['unquantized']:,} tokens unquantized, "
        f"{mt['int8']:,} with the Int8 cache {_gain(mt['unquantized'], mt['int8'])}"
        f"{_context_note(facts)}{_runs_out(plan.max_tokens_card) if several else ''}.",
    ]
    return "\n".join(lines)
