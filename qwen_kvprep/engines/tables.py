"""The engine smoke's text: per prompt where the backends part, and the KV cache table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from qwen_kvprep.engines.compare import KvRow


def _g(x: object) -> str:
    return f"{x:.2g}" if isinstance(x, float) else "-"


def parity_lines(engine: str, p: Mapping[str, object], kv_cache: Sequence[KvRow]) -> list[str]:
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
    if kv_cache:
        lines.append("KV cache dtypes against auto (the same prompts, greedy):")
        lines.append(f"  {'dtype':<22}{'usable':<8}{'same':<7}{'first parting':<18}"
                     f"{'max |Δ log p|':<15}note")
        for r in kv_cache:
            steps = ",".join("-" if s is None else str(s) for s in r["first_divergence"])
            same = f"{r['same']}/{r['prompts']}" if r["accepted"] else "-"
            note = r["why"] or ""
            lines.append(f"  {r['dtype']:<22}{'yes' if r['usable'] else 'NO':<8}{same:<7}"
                         f"{steps or '-':<18}{_g(r['max_logprob_delta']):<15}{note}")
    return lines
