"""The engine smoke's text: per prompt where the backends part, and the KV cache table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional, cast

from qwen_kvprep.engines.compare import KvRow
from qwen_kvprep.kvjudge import verdict
from qwen_kvprep.kvjudge.passage import TOP_K


def _g(x: object) -> str:
    return f"{x:.2g}" if isinstance(x, float) else "-"


def parity_lines(engine: str, p: Mapping[str, object]) -> list[str]:
    lines = [f"engine smoke: {engine}, {p.get('dtype')}, {p.get('new_tokens')} greedy "
             f"tokens per prompt (ties: top two within {_g(p.get('tie_below'))}; float32 "
             f"rounding: |Δ log p| within {_g(p.get('logprob_below'))})"]
    for pair in cast("list[dict[str, object]]", p.get("pairs", [])):
        lines.append(f"  {pair['a']} against {pair['b']}: "
                     + ("same" if pair["ok"] else "DIFFERENT"))
        for row in cast("list[dict[str, object]]", pair["prompts"]):
            step = row["first_divergence"]
            where = "all tokens equal" if step is None else (
                f"parts at token {step}, top two {_g(row['gap'])} apart"
                + (" (a tie)" if row["tie"] else ""))
            lines.append(f"    prompt {cast(int, row['prompt']) + 1}: {where}; max |Δ log p| "
                         f"{_g(row['max_logprob_delta'])}")
    return lines


def _scale(values: Sequence[float]) -> str:
    return f"{values[0]:.3g}" if values else "-"


def kv_lines(kv_cache: Sequence[KvRow], best: Optional[KvRow], tokens: int) -> list[str]:
    """The KV cache table: each dtype and scales against the unquantized cache, on the
    passage read through the cache in chunks."""
    if not kv_cache:
        return []
    chunk = next((r["chunk"] for r in kv_cache if r["chunk"]), None)
    lines = [f"KV cache dtypes against the unquantized cache (a passage of {tokens} tokens "
             f"read {chunk or '?'} at a time; KL over its top {TOP_K}; usable: top-1 "
             f"agreement >= {verdict.MIN_TOP1_AGREE:g} and mean KL <= "
             f"{verdict.MAX_KL_MEAN:g}):",
             f"  {'dtype':<21}{'scales':<12}{'usable':<8}{'kl_mean':<10}{'kl_p99':<10}"
             f"{'top1':<7}{'k/v scale, layer 0':<20}note"]
    for r in kv_cache:
        top1 = f"{r['top1_agree']:.3f}" if r["top1_agree"] is not None else "-"
        scale = (f"{_scale(r['engine_k_scale'])}/{_scale(r['engine_v_scale'])}"
                 if r["accepted"] else "-")
        lines.append(f"  {r['dtype']:<21}{r['scales']:<12}{'yes' if r['usable'] else 'NO':<8}"
                     f"{_g(r['kl_mean']):<10}{_g(r['kl_p99']):<10}{top1:<7}{scale:<20}"
                     f"{r['why'] or ''}")
    if best is None or best["resolved"] in (None, "auto"):
        lines.append("recommended: the unquantized cache (no quantized one is usable here)")
    else:
        where = ("OUT's own scales" if best["scales"] == "checkpoint" else "scales 1.0")
        size = best["bytes_per_value"] or 0.0
        lines.append(f"recommended: --kv-cache-dtype {best['dtype']} with {where} "
                     f"({size:g} byte{'' if size == 1 else 's'} a cached value)")
    return lines
