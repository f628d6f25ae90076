"""How far OUT's logits move from Qwen's own code past the trained context.

Up to `seq_length` the two are the same function: Qwen (v1) changes nothing there, and OUT
declares `max_position_embeddings = seq_length` with no rope scaling. Past it they part:
Qwen's code switches on dynamic NTK (the rotary base grows with the length of the whole
input, by its own rule) and logn attention (queries past seq_length scaled by
log_seq_length(position)), where the config says so; Qwen2 has no logn attention and its
dynamic NTK and YaRN scaling follow other rules. convert can declare one of those
(`--context-factor F --rope-scaling {yarn,dynamic}`); this module measures what that
costs, on one long input read in one forward by both models, so the user chooses
knowingly: the largest |Δlogit| and how often the top-1 token agrees.

`measure` runs in the verify child (torch imported there); `describe` is text only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from qwen_kvprep.convert.verify_protocol import ContextMeasure, ContextRow

if TYPE_CHECKING:
    import torch
    from transformers.modeling_utils import PreTrainedModel

# The lengths measured, in multiples of seq_length: the trained context itself (where an
# exact OUT shows ~0) and past it.
TIMES = (1.0, 2.0, 4.0)
# Logits are compared at this many positions at most (evenly spread over the part of the
# input the row is about), so a 32k-token input never materialises 32k x vocab logits.
MAX_POSITIONS = 256
# Qwen's code holds logn factors for positions below this; it cannot read further.
QWEN_LOGN_POSITIONS = 32767
# The text the long input repeats; any text works, this one tokenizes into ordinary
# tokens with any byte-level BPE.
FILLER = (
    "Rotary embeddings turn each position into an angle. Past the trained context the "
    "angles are new to the model, and every scheme that stretches them makes a choice. "
)


def rows_to_measure(seq_length: int) -> list[tuple[float, int]]:
    return [(t, int(seq_length * t)) for t in TIMES]


def attention_bytes(heads: int, tokens: int) -> int:
    """What one layer's attention scores for a `tokens`-long input take at most (fp32),
    when the attention is computed the plain way (a mask of its own rules out the fused
    kernels in Qwen's code)."""
    return heads * tokens * tokens * 4


def _positions(tokens: int, first: int) -> list[int]:
    """Up to MAX_POSITIONS positions evenly spread over [first, tokens), the last one
    always in."""
    span = tokens - first
    if span <= 0:
        return []
    step = max(1, -(-span // MAX_POSITIONS))
    chosen = list(range(tokens - 1, first - 1, -step))[:MAX_POSITIONS]
    return sorted(chosen)


def long_input(token_ids: list[int], tokens: int) -> list[int]:
    """`token_ids` (the filler, tokenized) repeated to exactly `tokens` ids."""
    if not token_ids:
        raise ValueError("the filler text tokenized to nothing")
    reps = -(-tokens // len(token_ids))
    return (token_ids * reps)[:tokens]


def _final_hidden(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    # the base model's output is after the final norm in both Qwen (v1) and Qwen2: only
    # the chosen positions then go through lm_head
    out = model.base_model(input_ids=ids, use_cache=False)
    hidden: torch.Tensor = out[0]
    return hidden


def _head(model: PreTrainedModel) -> torch.nn.Module:
    head: torch.nn.Module = model.get_output_embeddings()  # type: ignore[no-untyped-call, unused-ignore]
    return head


def measure(
    original: PreTrainedModel,
    converted: PreTrainedModel,
    *,
    filler_ids: list[int],
    seq_length: int,
    heads: int,
    budget_bytes: Optional[int],
    device: torch.device,
    rope_scaling: Optional[dict[str, object]],
    original_rules: list[str],
) -> ContextMeasure:
    """One row per TIMES: both models read the same long input; the logits at positions
    past seq_length (all positions for the 1x row) are compared. A row whose attention
    would not fit `budget_bytes` is skipped, saying why."""
    import torch

    rows: list[ContextRow] = []
    for times, tokens in rows_to_measure(seq_length):
        row: ContextRow = {
            "times": times,
            "tokens": tokens,
            "positions": 0,
            "max_abs": None,
            "top1_agreement": None,
            "skipped": None,
        }
        rows.append(row)
        if "logn attention" in original_rules and tokens > QWEN_LOGN_POSITIONS:
            row["skipped"] = (
                f"Qwen's code holds logn factors for {QWEN_LOGN_POSITIONS:,} positions only"
            )
            continue
        need = attention_bytes(heads, tokens)
        if budget_bytes is not None and need > budget_bytes:
            row["skipped"] = (
                f"a {tokens:,}-token forward needs about {need / 2**30:.1f} GiB for one "
                f"layer's attention scores; {budget_bytes / 2**30:.1f} GiB are free"
            )
            continue
        ids = torch.tensor([long_input(filler_ids, tokens)], device=device)
        first = 0 if times <= 1.0 else seq_length
        where = _positions(tokens, first)
        with torch.inference_mode():
            h_a = _final_hidden(original, ids)[0, where]
            logits_a = _head(original)(h_a).float()
            del h_a
            h_b = _final_hidden(converted, ids)[0, where]
            logits_b = _head(converted)(h_b).float()
            del h_b
        row["positions"] = len(where)
        row["max_abs"] = float((logits_a - logits_b).abs().max())
        same = (logits_a.argmax(dim=-1) == logits_b.argmax(dim=-1)).float().mean()
        row["top1_agreement"] = float(same)
    return {
        "seq_length": seq_length,
        "rope_scaling": rope_scaling,
        "original_rules": original_rules,
        "rows": rows,
    }


def describe(context: ContextMeasure) -> list[str]:
    """convert's lines: "at 2x seq_length (4,096 tokens): max |Δlogit| 3.1, top-1
    agreement 91.4% of 256 positions"."""
    rules = " and ".join(context["original_rules"]) or "no change past seq_length"
    scaling = context["rope_scaling"]
    declared = (
        f"OUT declares rope_scaling {scaling.get('rope_type', scaling.get('type'))} "
        f"factor {scaling.get('factor')}"
        if scaling
        else "OUT declares no rope scaling"
    )
    lines = [
        f"past the trained context ({context['seq_length']:,} tokens): Qwen's code uses "
        f"{rules}; {declared}"
    ]
    for row in context["rows"]:
        where = (
            "within seq_length"
            if row["times"] <= 1.0
            else f"at {row['times']:g}x seq_length"
        )
        head = f"  {where} ({row['tokens']:,} tokens): "
        if row["skipped"] is not None:
            lines.append(head + f"not measured: {row['skipped']}")
            continue
        assert row["max_abs"] is not None and row["top1_agreement"] is not None
        lines.append(
            head + f"max |Δlogit| {row['max_abs']:.3g}, top-1 agreement "
            f"{100 * row['top1_agreement']:.1f}% of {row['positions']} positions"
        )
    return lines


def original_rules(config: dict[str, object]) -> list[str]:
    """What Qwen's code does past seq_length, as its config.json asks."""
    rules = []
    if config.get("use_dynamic_ntk") is True:
        rules.append("dynamic NTK")
    if config.get("use_logn_attn") is True:
        rules.append("logn attention")
    return rules


def within_words(measured: object) -> Optional[str]:
    """The drift measured within seq_length (the 1x row), for the exactness claim:
    "measured within 2,048 tokens: max |Δlogit| 0.0042, top-1 agreement 99.2%"; None
    where nothing was measured there. `measured`: the verify child's result, or None."""
    context = measured.get("context") if isinstance(measured, dict) else None
    if not isinstance(context, dict):
        return None
    for row in context.get("rows", []):
        if row.get("times") == 1.0 and row.get("max_abs") is not None:
            agree = row.get("top1_agreement")
            share = f", top-1 agreement {100 * agree:.1f}%" if agree is not None else ""
            return (
                f"measured within {row['tokens']:,} tokens: max |Δlogit| "
                f"{row['max_abs']:.2g}{share}"
            )
    return None
