"""Whether a quantized KV cache is usable, from its score against the unquantized cache
(metrics.score): one rule for every backend's rows. Pure.

usable iff top1_agree >= MIN_TOP1_AGREE and kl_mean <= MAX_KL_MEAN.

Why these two numbers (docs/reference.md gives the measurements):
- top-1 agreement tells a broken cache from a sound one on every model: a cache whose
  values saturate or hold garbage moves the most likely token at nearly every position
  (0.006 to 0.07 measured, on vLLM-CPU and on the transformers reference), a sound fp8
  cache at a few positions where the top two tokens are close (0.80 to 0.99: on a tiny
  random model many positions are near ties, on a trained one few are). 0.5 lies far
  from both.
- kl_mean bounds how far the distributions move where the top token happens to stay: a
  sound fp8 cache moves a trained model's next-token distribution by some 1e-3 to 1e-2
  nats on average, a cache at the wrong scale by tenths and more. 0.05 nats lies between.
  On a tiny random model every distribution is near uniform and every KL is small (below
  1e-3 even for a broken cache), so there top-1 agreement decides.
"""

from __future__ import annotations

from typing import Optional

from qwen_kvprep.kvjudge.metrics import Score

MIN_TOP1_AGREE = 0.5
MAX_KL_MEAN = 0.05


def why_unusable(score: Score) -> Optional[str]:
    """Why the cache scored `score` is not usable (None: it is)."""
    reasons = []
    if not score.top1_agree >= MIN_TOP1_AGREE:  # NaN is never usable
        reasons.append(f"top-1 agreement {score.top1_agree:.3f} < {MIN_TOP1_AGREE}")
    if not score.kl_mean <= MAX_KL_MEAN:
        reasons.append(f"mean KL {score.kl_mean:.3g} > {MAX_KL_MEAN} nats")
    return "; ".join(reasons) or None


def usable(score: Score) -> bool:
    return why_unusable(score) is None


__all__ = ["MAX_KL_MEAN", "MIN_TOP1_AGREE", "usable", "why_unusable"]
