"""Pure comparisons: of greedy runs, where two backends part and whether that is a tie;
of KV caches, what each does to the passage's next-token distributions against the
unquantized cache (kvjudge), and which one to serve with (no model, no engine: testable
on made-up numbers).

What float32 rounding can explain (`bounds`): two implementations of one model give logits
that differ by at most delta = TOL * S, TOL convert's proof's own float32 tolerance relative
to S, the largest |logit|. A tie is a step where the reference's top two logits are within
delta: there either token is the model's answer. log p = z - logsumexp(z), and logsumexp
moves by at most the largest move of a logit, so a chosen token's log-probability moves by
at most 2 * delta, plus the rounding of log_softmax itself in float32 on values up to
S + ln(V) (V the vocabulary): TOL * (S + ln V). Parting anywhere else, or log-probabilities
further apart, means the two compute different models. S is capped at LOGIT_LIMIT: a
corrupt weight that makes a logit huge must not widen what counts as rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, TypedDict

from qwen_kvprep.engines.protocol import Backend, EngineResult, Run
from qwen_kvprep.kvjudge import verdict
from qwen_kvprep.kvjudge.metrics import score

# Past this |logit| the proof cannot tell a model from rounding: float32 would excuse
# log-probabilities 3 % apart (TOL * 3 * S), and e^-1000 is zero in every float type.
# Trained models' heads give logits of a few tens; a flipped exponent bit gives 1e36.
LOGIT_LIMIT = 1000.0


@dataclass(frozen=True)
class Bounds:
    """What float32 rounding explains between two implementations (see the module's
    docstring for the derivation)."""

    scale: float  # S: the largest |logit| they are relative to, at most LOGIT_LIMIT
    tie: float  # a top-two gap within this is a tie
    logprob: float  # a |Δ log p| beyond this is not rounding


def bounds(rel: float, scale: float, vocab: int) -> Bounds:
    s = min(scale, LOGIT_LIMIT) if math.isfinite(scale) and scale >= 0.0 else LOGIT_LIMIT
    delta = rel * s
    return Bounds(s, delta, 2.0 * delta + rel * (s + math.log(max(vocab, 2))))


def absurd(scale: Optional[float]) -> bool:
    """A largest |logit| that is NaN, infinite or past LOGIT_LIMIT: no proof by rounding."""
    return scale is not None and not (math.isfinite(scale) and abs(scale) <= LOGIT_LIMIT)


@dataclass(frozen=True)
class Parting:
    prompt: int
    step: Optional[int]  # the first step whose tokens differ; None: all equal
    gap: Optional[float]  # the reference's top-1 minus top-2 logit at that step
    tie: bool  # the gap is within rounding: either token is the model's
    logprob_delta: float  # largest |Δ log p| of the tokens both chose before parting

    def to_json(self) -> dict[str, object]:
        # strict JSON has no inf or NaN: null there (the finding says what was wrong)
        return {"prompt": self.prompt, "first_divergence": self.step, "gap": _finite(self.gap),
                "tie": self.tie, "max_logprob_delta": _finite(self.logprob_delta)}


def _finite(x: Optional[float]) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None


def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    """The first index where the two differ (one ending early counts as differing)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def part(ref: Run, other: Run, tie_below: float) -> Parting:
    step = first_divergence(ref["tokens"], other["tokens"])
    shared = len(ref["tokens"]) if step is None else step
    # NaN is no smaller than anything: it counts as infinitely far
    deltas = [_far(x, y) for x, y in zip(ref["logprobs"][:shared], other["logprobs"][:shared])]
    gap = ref["gaps"][step] if step is not None and step < len(ref["gaps"]) else None
    tie = step is not None and gap is not None and gap <= tie_below
    return Parting(ref["prompt"], step, gap, tie, max(deltas, default=0.0))


def _far(x: float, y: float) -> float:
    d = abs(x - y)
    return d if math.isfinite(d) else math.inf


def compare(ref: Backend, other: Backend, tie_below: float) -> list[Parting]:
    """One Parting per prompt both ran, in the reference's order."""
    theirs = {r["prompt"]: r for r in other["runs"]}
    return [part(r, theirs[r["prompt"]], tie_below) for r in ref["runs"] if r["prompt"] in theirs]


def agrees(partings: list[Parting], logprob_below: float = math.inf) -> bool:
    """No prompt parts anywhere but at a tie, and no log-probability before moves past
    `logprob_below`."""
    return all((p.step is None or p.tie) and p.logprob_delta <= logprob_below
               for p in partings)


def moved(partings: list[Parting], logprob_below: float) -> list[Parting]:
    """The prompts whose log-probabilities moved past what rounding explains."""
    return [p for p in partings if not p.logprob_delta <= logprob_below]


# Bytes one cached K or V value takes, per dtype (auto: the model's dtype, `model_bytes`).
# int8_per_token_head also keeps a float32 scale per token and head, which `cache_bytes`
# adds per value of the head.
QUANTIZED_BYTES = {"fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "int8_per_token_head": 1.0}
PER_HEAD_SCALE = {"int8_per_token_head": 4.0}


def cache_bytes(resolved: Optional[str], model_bytes: float, head_dim: int) -> float:
    """Bytes a cached value takes with the dtype the engine's cache config resolved to."""
    base = QUANTIZED_BYTES.get(resolved or "auto", model_bytes)
    return base + PER_HEAD_SCALE.get(resolved or "auto", 0.0) / max(head_dim, 1)


class KvRow(TypedDict):
    """One KV cache dtype (and scales) against the engine's unquantized cache (auto on
    OUT without its scales), on the passage (kvjudge.passage)."""

    dtype: str
    scales: str  # "checkpoint" (OUT's k_scale/v_scale) or "1.0"
    accepted: bool  # the engine started with it and scored the passage
    resolved: Optional[str]  # the dtype the engine's cache config holds
    declared: bool  # the engine's attention backend here declares the dtype
    usable: bool
    why: Optional[str]  # why it is not usable
    kl_mean: Optional[float]
    kl_p99: Optional[float]
    top1_agree: Optional[float]
    tokens_scored: int
    chunk: Optional[int]  # prompt tokens a step read: later chunks read earlier ones back
    engine_k_scale: list[float]  # per layer, as the engine's attention layers hold them
    engine_v_scale: list[float]
    bytes_per_value: Optional[float]  # what one cached K or V value takes


def positions(scored: list[dict[str, float]]) -> list[dict[int, float]]:
    return [{int(t): lp for t, lp in step.items()} for step in scored]


def kv_row(
    dtype: str, scales: str, reference: list[dict[int, float]], got: Optional[EngineResult],
    error: Optional[str], declared: list[str], value_bytes: Callable[[Optional[str]], float],
) -> KvRow:
    """Judge one engine start against the reference. `got` None: the engine refused it or
    failed (`error` says how). `declared`: the dtypes the engine's attention backend here
    declares (empty when unknown: then nothing is refused for it)."""
    is_declared = not declared or dtype in declared
    row: KvRow = {
        "dtype": dtype, "scales": scales, "accepted": got is not None,
        "resolved": got["resolved_kv_cache_dtype"] if got else None,
        "declared": is_declared, "usable": False,
        "why": None if got else (error or "the engine did not run with it"),
        "kl_mean": None, "kl_p99": None, "top1_agree": None, "tokens_scored": 0,
        "chunk": got["chunk"] if got else None,
        "engine_k_scale": list(got["engine_k_scale"]) if got else [],
        "engine_v_scale": list(got["engine_v_scale"]) if got else [],
        "bytes_per_value": value_bytes(got["resolved_kv_cache_dtype"]) if got else None,
    }
    if got is None:
        return row
    test = positions(got["scored"])
    try:
        s = score(reference, test)
    except ValueError as exc:
        row["why"] = f"the passage could not be scored: {exc}"
        return row
    row["kl_mean"], row["kl_p99"] = s.kl_mean, s.kl_p99
    row["top1_agree"], row["tokens_scored"] = s.top1_agree, s.tokens_scored
    quantized = row["resolved"] not in (None, "auto")
    if not is_declared:
        row["why"] = (f"the engine's attention backend here does not declare {dtype} "
                      f"(it declares {', '.join(declared)}): whatever it computes is "
                      "not a supported cache")
    elif quantized and test == reference:
        row["why"] = ("accepted but it does not quantize: every log-probability is the "
                      "unquantized cache's, bit for bit")
    else:
        row["why"] = verdict.why_unusable(s)
    row["usable"] = row["why"] is None
    return row


def recommend(rows: list[KvRow]) -> Optional[KvRow]:
    """The usable row that saves the most memory (fewest bytes a value); among equals the
    one closest to the unquantized cache (lowest mean KL), then one that names its dtype
    (`auto` on a folder with scales is fp8 too, said less plainly), then the first listed."""
    usable = [r for r in rows if r["usable"] and r["bytes_per_value"] is not None]
    if not usable:
        return None
    return min(usable, key=lambda r: (r["bytes_per_value"], r["kl_mean"] or 0.0,
                                      r["dtype"] == "auto"))
