"""Judge the Int8 cache's passage (smoke/kvscore.py) by the numbers the engine smoke gives
vLLM's caches: KL over the unquantized cache's top-k and top-1 agreement (kvjudge), usable
by the same declared thresholds. Pure: the child only measured."""

from __future__ import annotations

from typing import Optional, TypedDict

from qwen_kvprep.findings import Finding, ok, warn
from qwen_kvprep.kvjudge import verdict
from qwen_kvprep.kvjudge.metrics import score
from qwen_kvprep.smoke.protocol import KvPassage

CACHE = "int8 (the model's own code: uint8 with a scale and zero point per head and chunk)"


class KvScore(TypedDict):
    """The Int8 cache against the model's unquantized cache on the passage, under the
    engine smoke's KV table's JSON names."""

    cache: str
    usable: bool
    why: Optional[str]
    kl_mean: Optional[float]
    kl_p99: Optional[float]
    top1_agree: Optional[float]
    tokens_scored: int
    chunk: int


def _positions(scored: list[dict[str, float]]) -> list[dict[int, float]]:
    return [{int(t): lp for t, lp in step.items()} for step in scored]


def judge_passage(passage: KvPassage) -> tuple[Finding, KvScore]:
    row: KvScore = {"cache": CACHE, "usable": False, "why": None, "kl_mean": None,
                    "kl_p99": None, "top1_agree": None, "tokens_scored": 0,
                    "chunk": passage["chunk"]}
    try:
        s = score(_positions(passage["unquantized"]), _positions(passage["quantized"]))
    except ValueError as exc:
        row["why"] = f"the passage could not be scored: {exc}"
        return warn("smoke.kv_score", f"the Int8 cache was not scored: {exc}"), row
    row.update({"kl_mean": s.kl_mean, "kl_p99": s.kl_p99, "top1_agree": s.top1_agree,
                "tokens_scored": s.tokens_scored})
    words = (f"the Int8 cache against the unquantized cache on a passage of "
             f"{passage['tokens']} tokens read {passage['chunk']} at a time: kl_mean "
             f"{s.kl_mean:.2g}, kl_p99 {s.kl_p99:.2g}, top1_agree {s.top1_agree:.3f} (as "
             "`smoke OUT --engine vllm` judges vLLM's caches")
    row["why"] = verdict.why_unusable(s)
    if row["why"] is None:
        row["usable"] = True
        return ok("smoke.kv_score", words + ": usable)", **row), row
    return warn("smoke.kv_score", words + f": not usable, {row['why']})", **row), row
