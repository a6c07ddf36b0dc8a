"""Summary statistics shared by the eval reports and the benchmarks: percentiles and
percentile-bootstrap intervals."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles(
    values: Sequence[float | None], points: Sequence[int] = (50, 95, 99)
) -> dict[str, float | None]:
    """`p50`, `p95`, ... and `mean` of the finite values, rounded to 3 places; None for no values."""
    finite = [float(value) for value in values if value is not None and math.isfinite(value)]
    summary: dict[str, float | None] = {
        f"p{point}": round(percentile(finite, point), 3) if finite else None for point in points
    }
    summary["mean"] = round(sum(finite) / len(finite), 3) if finite else None
    return summary


def interval_of(estimates: Sequence[float], confidence: float) -> tuple[float, float]:
    """The central `confidence` share of bootstrap estimates (the percentile interval)."""
    tail = (1 - confidence) / 2 * 100
    return percentile(estimates, tail), percentile(estimates, 100 - tail)


@dataclass
class Estimate:
    """A mean with a percentile-bootstrap confidence interval."""

    value: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    confidence: float = 0.95

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)

    @property
    def excludes_zero(self) -> bool:
        return self.ci_low is not None and self.ci_high is not None and (self.ci_low > 0 or self.ci_high < 0)


def bootstrap_mean(
    values: Sequence[float | None], resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> Estimate:
    """The mean of the values (None left out) with a seeded percentile-bootstrap interval."""
    data = np.asarray([value for value in values if value is not None], dtype=float)
    if data.size == 0:
        return Estimate(None, None, None, 0, confidence)
    indices = np.random.default_rng(seed).integers(0, data.size, size=(resamples, data.size))
    low, high = interval_of(data[indices].mean(axis=1).tolist(), confidence)
    return Estimate(
        value=round(float(data.mean()), 6),
        ci_low=round(low, 6),
        ci_high=round(high, 6),
        n=int(data.size),
        confidence=confidence,
    )


def paired_bootstrap_difference(
    baseline: dict[str, float | None],
    candidate: dict[str, float | None],
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """candidate - baseline over the questions both scored (paired by question id), with a bootstrap
    interval that resamples questions, so per-question difficulty cancels out."""
    shared_ids = sorted(
        key
        for key in baseline.keys() & candidate.keys()
        if baseline[key] is not None and candidate[key] is not None
    )
    differences = [float(candidate[key]) - float(baseline[key]) for key in shared_ids]  # type: ignore[arg-type]
    return bootstrap_mean(differences, resamples=resamples, confidence=confidence, seed=seed)


def p95_ratio_interval(
    numerators: Sequence[float],
    denominators: Sequence[float],
    confidence: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> list[float] | None:
    """A percentile-bootstrap interval for P95(numerators) / P95(denominators).

    A P95 over a few dozen requests stands on its top one or two, so a ratio of two of them moves by
    more than a 10% bar from run to run; the interval says how far. Requests are resampled
    independently within each arm; those of one burst are not independent, so the true spread is if
    anything wider. Seeded: the same samples give the same interval.
    """
    if len(numerators) < 2 or len(denominators) < 2:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        denominator = percentile(rng.choices(denominators, k=len(denominators)), 95)
        if denominator > 0:
            ratios.append(percentile(rng.choices(numerators, k=len(numerators)), 95) / denominator)
    if not ratios:
        return None
    low, high = interval_of(ratios, confidence)
    return [round(low, 3), round(high, 3)]
