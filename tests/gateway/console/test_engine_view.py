"""The engine page's percentiles are Prometheus' histogram_quantile over the gateway's own buckets."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from ctxgate.gateway.console.engine_view import histogram_buckets, percentiles, quantile


def test_quantiles_interpolate_within_the_bucket_as_prometheus_does():
    registry = CollectorRegistry()
    histogram = Histogram("t_seconds", "t", buckets=(0.1, 0.2, 0.4), registry=registry)
    for value in (0.05,) * 2 + (0.15,) * 6 + (0.3,) * 2:
        histogram.observe(value)
    buckets = histogram_buckets(registry, "t_seconds")
    assert buckets == [(0.1, 2.0), (0.2, 8.0), (0.4, 10.0), (float("inf"), 10.0)]
    # rank 5 of 10 falls in (0.1, 0.2] holding ranks 3..8: 0.1 + 0.1 * (5 - 2) / 6
    assert abs(quantile(0.5, buckets) - 0.15) < 1e-9
    assert abs(quantile(0.9, buckets) - 0.3) < 1e-9
    histogram.observe(9.0)  # beyond the last finite bound: the highest finite bound, as Prometheus says
    assert quantile(0.99, histogram_buckets(registry, "t_seconds")) == 0.4


def test_no_observation_no_percentile():
    registry = CollectorRegistry()
    Histogram("t_seconds", "t", buckets=(0.1,), registry=registry)
    empty = percentiles(registry, "t_seconds")
    assert empty.count == 0 and set(empty.values.values()) == {None}
