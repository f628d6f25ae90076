"""The KV judge's numbers on hand-made distributions."""

from __future__ import annotations

import math

import pytest

from qwen_kvprep.kvjudge.metrics import kl_at, percentile, score, top1


def test_identical_distributions_score_zero_and_agree() -> None:
    ref = [{1: math.log(0.7), 2: math.log(0.2), 3: math.log(0.1)}] * 5
    s = score(ref, ref)
    assert s.kl_mean == 0.0 and s.kl_p99 == 0.0
    assert s.top1_agree == 1.0 and s.tokens_scored == 5


def test_kl_is_the_textbook_value_on_the_reference_set() -> None:
    p = {1: math.log(0.5), 2: math.log(0.5)}
    q = {1: math.log(0.9), 2: math.log(0.1)}
    want = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_at(p, q) == pytest.approx(want, rel=1e-12)


def test_a_token_the_test_did_not_return_gets_its_smallest_log_probability() -> None:
    p = {1: math.log(0.6), 2: math.log(0.4)}
    q = {1: math.log(0.8), 3: math.log(0.05)}  # 2 missing: bounded by 0.05
    assert kl_at(p, q) == pytest.approx(kl_at(p, {1: math.log(0.8), 2: math.log(0.05)}))


def test_a_moved_top1_counts_against_agreement() -> None:
    a = {1: -0.1, 2: -2.0}
    b = {1: -2.0, 2: -0.1}
    s = score([a, a, a, a], [a, b, a, b])
    assert s.top1_agree == 0.5 and s.kl_mean > 0


def test_ties_break_alike_on_both_sides() -> None:
    assert top1({5: -1.0, 3: -1.0, 9: -2.0}) == 3


def test_percentile_interpolates() -> None:
    assert percentile([0.0, 1.0], 50) == 0.5
    assert percentile(list(range(101)), 99) == 99.0


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        score([], [])
    with pytest.raises(ValueError):
        score([{1: 0.0}], [])
    with pytest.raises(ValueError):
        kl_at({1: float("nan")}, {1: 0.0})
