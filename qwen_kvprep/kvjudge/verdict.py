"""Whether a KV cache's score is good enough to serve with: declared thresholds, pure.

A cache is usable when its top-1 agreement with the unquantized cache is at least
TOP1_AGREE_MIN and its mean KL at most KL_MEAN_MAX (kvjudge.metrics gives both).
"""

from __future__ import annotations

from qwen_kvprep.kvjudge.metrics import Score

TOP1_AGREE_MIN = 0.8
KL_MEAN_MAX = 0.05


def usable(score: Score) -> bool:
    return score.top1_agree >= TOP1_AGREE_MIN and score.kl_mean <= KL_MEAN_MAX
