"""The prefill cost model fit and the saving summary."""

from __future__ import annotations

import pytest

from ctxgate.eval.bench_prefill import fit_linear, summarize_pairs


def test_fit_recovers_a_line_and_reports_r2():
    tokens = [100, 400, 800, 1600, 2400]
    fit = fit_linear(tokens, [5 + 0.25 * t for t in tokens])
    assert fit.intercept_ms == pytest.approx(5) and fit.ms_per_token == pytest.approx(0.25)
    assert fit.r2 == pytest.approx(1.0) and fit.n == 5
    assert fit.predict(1000) == pytest.approx(255)
    with pytest.raises(ValueError, match="different prompt lengths"):
        fit_linear([100, 100], [1, 2])


def test_saving_per_1k_tokens_removed():
    def sample(tokens, compression=0.0):
        return {
            "prompt_tokens": tokens,
            "prefill_ms": tokens * 0.2,
            "ttft_ms": tokens * 0.2 + 3,
            "compression_ms_total": compression,
        }

    pairs = [
        {"full": sample(2000), "compressed": sample(500, 4.0)},
        {"full": sample(2200), "compressed": sample(200, 6.0)},
    ]
    summary = summarize_pairs(pairs)
    assert summary["tokens_removed_mean"] == pytest.approx(1750)
    assert summary["prefill_ms_saved_per_1k_tokens_removed"] == pytest.approx(200)
    assert summary["ttft_ms_saved_per_1k_tokens_removed_median"] == pytest.approx(200)
    assert summary["net_ttft_saved_ms_mean"] == pytest.approx(350 - 5)


def test_quadratic_fit_is_reported_when_lengths_allow():
    from ctxgate.eval.bench_prefill import fit_quadratic

    tokens = [100.0, 500.0, 1000.0, 2000.0]
    fit = fit_quadratic(tokens, [2 + 0.1 * t + 0.001 * t * t for t in tokens])
    assert fit["ms_per_token_squared"] == pytest.approx(0.001) and fit["intercept_ms"] == pytest.approx(
        2, abs=1e-6
    )
    assert fit_quadratic([1.0, 1.0, 2.0], [1.0, 1.0, 2.0]) is None
