"""Answer scoring, percentiles and bootstrap intervals."""

from __future__ import annotations

import random

import pytest

from eval.metrics import (
    answer_in_text,
    bootstrap_mean,
    exact_match,
    normalize_answer,
    paired_bootstrap_difference,
    percentiles,
    token_f1,
)


def test_normalization_drops_case_punctuation_articles():
    assert normalize_answer("The  Beatles!") == "beatles"
    assert normalize_answer("“Gayla Peevey”.") == "gayla peevey"


def test_accuracy_is_whole_word_containment():
    assert answer_in_text("It was sung by Gayla Peevey in 1953.", ["Gayla Peevey"])
    assert answer_in_text("answer: the beatles", ["Beatles", "John"])
    assert not answer_in_text("nobody knows", ["no"])
    assert not answer_in_text("", ["x"])


def test_exact_match_and_f1():
    assert exact_match("The Beatles.", ["beatles"])
    assert not exact_match("The Beatles band", ["beatles"])
    assert token_f1("the beatles band", ["Beatles"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert token_f1("rolling stones", ["Beatles"]) == 0.0
    assert token_f1("x", ["nope", "x"]) == 1.0


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
