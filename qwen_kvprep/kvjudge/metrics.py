"""KL divergence and top-1 agreement of next-token distributions, over the reference's
top-k tokens.

Method (the same for every backend, so rows compare): at each scored position the
reference (the unquantized cache) gives its k most likely tokens with their
log-probabilities, and the cache under test gives log-probabilities for tokens it ranks.
Both are restricted to the reference's top-k set and renormalised there, and
KL(reference || test) is taken over that set. A token of the reference's set that the test
did not return is given the smallest log-probability the test returned at that position:
the test ranked it below everything it returned, so that is an upper bound on its
probability. Engines return only a top-k (vLLM: at most 20 by default), which is why the
distribution is not taken whole; the top 20 of a next-token distribution carry nearly all
of its mass on a trained model.

top-1 agreement: the share of positions where the test's most likely token is the
reference's most likely token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# A position's top-k: token id -> log-probability.
TopK = Mapping[int, float]


@dataclass(frozen=True)
class Score:
    kl_mean: float
    kl_p99: float
    top1_agree: float
    tokens_scored: int

    def to_json(self) -> dict[str, object]:
        return {"kl_mean": self.kl_mean, "kl_p99": self.kl_p99,
                "top1_agree": self.top1_agree, "tokens_scored": self.tokens_scored}


def kl_at(ref: TopK, test: TopK) -> float:
    """KL(ref || test) over ref's tokens, both renormalised on that set (see the module)."""
    if not ref:
        raise ValueError("the reference returned no tokens at this position")
    if not test:
        raise ValueError("the cache under test returned no tokens at this position")
    floor = min(test.values())
    ids = list(ref)
    p = _normalised([ref[i] for i in ids])
    q = _normalised([test.get(i, floor) for i in ids])
    kl = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0.0)
    return max(kl, 0.0)  # rounding can make an exact match a hair negative


def _normalised(logps: Sequence[float]) -> list[float]:
    for x in logps:
        if not math.isfinite(x) and x != -math.inf:
            raise ValueError(f"log-probability {x} is not a number")
    top = max(logps)
    if top == -math.inf:
        raise ValueError("every log-probability is -inf")
    w = [math.exp(x - top) for x in logps]
    s = sum(w)
    return [x / s for x in w]


def top1(d: TopK) -> int:
    """The most likely token; the smaller id on an exact tie, so both sides break ties alike."""
    best = max(d.values())
    return min(i for i, v in d.items() if v == best)


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    if not xs:
        raise ValueError("no values")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def score(ref: Sequence[TopK], test: Sequence[TopK]) -> Score:
    """Score the cache under test against the reference, position by position (the same
    passage, the same positions, in order)."""
    if len(ref) != len(test):
        raise ValueError(f"{len(ref)} reference positions against {len(test)} tested")
    if not ref:
        raise ValueError("no positions to score")
    kls = [kl_at(r, t) for r, t in zip(ref, test)]
    agree = sum(1 for r, t in zip(ref, test) if top1(r) == top1(t))
    return Score(kl_mean=sum(kls) / len(kls), kl_p99=percentile(kls, 99.0),
                 top1_agree=agree / len(ref), tokens_scored=len(ref))
