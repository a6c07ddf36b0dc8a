"""Percentiles and percentile-bootstrap intervals (eval/stats.py)."""

from __future__ import annotations

import random

import pytest

from ctxgate.eval.stats import (
    bootstrap_mean,
    p95_ratio_interval,
    paired_bootstrap_difference,
    percentile,
    percentiles,
)


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile(list(range(101)), 95) == 95


def test_percentiles_and_empty_input():
    summary = percentiles(list(range(1, 101)))
    assert summary["p50"] == pytest.approx(50.5) and summary["p99"] == pytest.approx(99.01)
    assert summary["mean"] == pytest.approx(50.5)
    assert percentiles([])["p95"] is None


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_n():
    rng = random.Random(1)
    small = [float(rng.random() < 0.6) for _ in range(30)]
    large = [float(rng.random() < 0.6) for _ in range(1000)]
    small_estimate = bootstrap_mean(small)
    large_estimate = bootstrap_mean(large)
    for estimate in (small_estimate, large_estimate):
        assert estimate.ci_low <= estimate.value <= estimate.ci_high
    assert (large_estimate.ci_high - large_estimate.ci_low) < (small_estimate.ci_high - small_estimate.ci_low)
    assert bootstrap_mean([None, None]).value is None


def test_paired_difference_detects_a_real_drop_but_not_noise():
    ids = [f"q{i}" for i in range(300)]
    baseline = {qid: 1.0 if i % 2 else 0.0 for i, qid in enumerate(ids)}
    dropped = dict(baseline)
    for qid in ids[1:120:2]:  # 60 of the 150 correct answers become wrong
        dropped[qid] = 0.0
    estimate = paired_bootstrap_difference(baseline, dropped)
    assert estimate.value == pytest.approx(-0.2)
    assert estimate.excludes_zero and estimate.ci_high < 0
    same = paired_bootstrap_difference(baseline, dict(baseline))
    assert same.value == 0 and not same.excludes_zero
    # Unpaired questions and None scores are left out.
    partial = paired_bootstrap_difference({"a": 1.0, "b": None}, {"a": 0.0, "c": 1.0})
    assert partial.n == 1 and partial.value == -1.0


def test_p95_ratio_interval_brackets_the_ratio_and_narrows_with_more_requests():
    import random

    rng = random.Random(7)

    # the same latency distribution, 10% slower: the ratio of P95s is 1.1 in the limit
    def draw(count: int, scale: float) -> list[float]:
        return [scale * rng.lognormvariate(7.0, 0.4) for _ in range(count)]

    few = p95_ratio_interval(draw(24, 1.1), draw(24, 1.0))
    many = p95_ratio_interval(draw(960, 1.1), draw(960, 1.0))
    assert few is not None and many is not None
    assert few[0] < few[1] and many[0] < 1.1 < many[1]
    assert many[1] - many[0] < (few[1] - few[0]) / 2  # 40x the requests, a much tighter interval
    assert p95_ratio_interval([1.0, 2.0, 3.0], [1.0, 2.0]) == p95_ratio_interval([1.0, 2.0, 3.0], [1.0, 2.0])
    assert p95_ratio_interval([1.0], [1.0, 2.0]) is None  # one request has no spread to resample
