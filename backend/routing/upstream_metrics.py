"""Per-upstream health and latency for `UpstreamClient` (exported on the gateway's /metrics).

Health is read from the client's own failover state at scrape time, so the gauge says exactly what
the router believes: 0 while a URL is being skipped after a failure, 1 otherwise.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
FAILURE_KINDS = ("connect", "status", "timeout", "stream")


def upstream_label(url: str) -> str:
    """The URL without credentials (user:password@ must never reach a metrics backend)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class _Health:
    def __init__(self, client: Any):
        self.client = client

    def describe(self):
        return []

    def collect(self):
        family = GaugeMetricFamily(
            "ctxgate:upstream_up",
            "1 when the upstream is routed to, 0 while skipped after a failure",
            labels=["upstream"],
        )
        now = time.monotonic()
        for url in self.client.config.urls:
            family.add_metric([upstream_label(url)], 0 if self.client._down_until.get(url, 0) > now else 1)
        yield family


class UpstreamMetrics:
    def __init__(self, client: Any):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "ctxgate:upstream_ttft_seconds",
            "time from sending to the upstream's first token",
            ["upstream"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "ctxgate:upstream_request_seconds",
            "whole upstream request (stream included)",
            ["upstream"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "ctxgate:upstream_failures",
            "failed upstream attempts by kind (connect, status: 5xx failover, timeout, stream: cut mid-way)",
            ["upstream", "kind"],
            registry=r,
        )
        r.register(_Health(client))
        for url in client.config.urls:  # series exist from the start, so rates work before the first error
            label = upstream_label(url)
            self.ttft.labels(label)
            self.duration.labels(label)
            for kind in FAILURE_KINDS:
                self.failures.labels(label, kind)

    def observe(self, url: str, ttft_s: float, duration_s: float) -> None:
        label = upstream_label(url)
        self.ttft.labels(label).observe(ttft_s)
        self.duration.labels(label).observe(duration_s)

    def failure(self, url: str, kind: str) -> None:
        self.failures.labels(upstream_label(url), kind).inc()
