"""Pure comparisons of greedy runs: where two backends part, whether that is a tie, and
what a KV cache dtype does to the engine's own tokens (no model, no engine: testable on
made-up runs).

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
from typing import Optional, TypedDict

from qwen_kvprep.engines.protocol import Backend, Run

# A quantized cache that moves the first token of most prompts does not hold the cache it
# was given: the first token comes from the prompt's own attention, which only reads back
# what the cache-write kernel stored.
BROKEN_AT_STEP = 0

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


def identical(a: Backend, b: Backend) -> bool:
    """The same tokens and the very same log-probabilities for every prompt: a cache that
    quantizes moves the log-probabilities at least in their last bits."""
    theirs = {r["prompt"]: r for r in b["runs"]}
    return len(theirs) == len(a["runs"]) and all(
        r["prompt"] in theirs and r["tokens"] == theirs[r["prompt"]]["tokens"]
        and r["logprobs"] == theirs[r["prompt"]]["logprobs"]
        for r in a["runs"]
    )


class KvRow(TypedDict):
    """One KV cache dtype against the engine's unquantized cache (auto)."""

    dtype: str
    accepted: bool  # the engine started with it and generated
    resolved: Optional[str]  # the dtype the engine's cache config holds
    usable: bool
    why: Optional[str]  # why it is not usable
    prompts: int
    same: int  # prompts whose tokens all equal auto's
    first_divergence: list[Optional[int]]  # per prompt
    gap: list[Optional[float]]  # auto's top-2 gap where the prompt parted
    max_logprob_delta: Optional[float]  # over the steps before parting, all prompts
    seconds: Optional[float]


def kv_row(
    dtype: str, auto: Backend, got: Optional[Backend], resolved: Optional[str],
    error: Optional[str],
) -> KvRow:
    """Judge one dtype. `got` None: the engine refused it or failed (`error` says how)."""
    if got is None:
        return {"dtype": dtype, "accepted": False, "resolved": resolved, "usable": False,
                "why": error or "the engine did not run with it", "prompts": 0, "same": 0,
                "first_divergence": [], "gap": [], "max_logprob_delta": None,
                "seconds": None}
    partings = compare(auto, got, tie_below=0.0)
    steps = [p.step for p in partings]
    why: Optional[str] = None
    if dtype != "auto" and identical(auto, got):
        why = ("accepted but it does not quantize: every token and log-probability is "
               "auto's, bit for bit")
    else:
        early = sum(1 for s in steps if s is not None and s <= BROKEN_AT_STEP)
        if dtype != "auto" and early * 2 > len(steps):
            why = (f"tokens part from auto at step {BROKEN_AT_STEP} on {early} of "
                   f"{len(steps)} prompts: the cache does not hold what was written to it")
    return {
        "dtype": dtype, "accepted": True, "resolved": resolved, "usable": why is None,
        "why": why, "prompts": len(partings), "same": sum(1 for s in steps if s is None),
        "first_divergence": steps, "gap": [p.gap for p in partings],
        "max_logprob_delta": max((p.logprob_delta for p in partings), default=0.0),
        "seconds": got["seconds"],
    }
