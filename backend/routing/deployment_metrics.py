"""Per-deployment metrics of the model groups (exported on the gateway's /metrics).

In-flight counts and health are read from the groups at scrape time, so the gauges say exactly what
the router sees. Deployment labels are URLs without credentials (`upstream_label`) or `builtin`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ERROR_KINDS = ("unavailable", "timeout", "overloaded", "stream")


@dataclass(frozen=True)
class DeploymentState:
    model: str
    deployment: str
    in_flight: int
    up: bool


class _Live:
    """Gauges computed at scrape time from the groups' own state."""

    def __init__(self, states: Callable[[], Iterable[DeploymentState]]) -> None:
        self.states = states

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "ctxgate:deployment_in_flight",
            "requests this gateway has in flight on the deployment",
            labels=["model", "deployment"],
        )
        up = GaugeMetricFamily(
            "ctxgate:deployment_up",
            "1 when the deployment is routed to, 0 while ejected",
            labels=["model", "deployment"],
        )
        for state in self.states():
            in_flight.add_metric([state.model, state.deployment], state.in_flight)
            up.add_metric([state.model, state.deployment], 1 if state.up else 0)
        yield in_flight
        yield up


class Reexport:
    """Another registry's metrics on this one (the built-in engine's, behind a model group)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()


class DeploymentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ["model", "deployment"]
        self.ttft = Histogram(
            "ctxgate:deployment_ttft_seconds",
            "time from sending to the deployment's first token",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "ctxgate:deployment_requests", "requests the deployment started streaming", labels, registry=r
        )
        self.errors = Counter(
            "ctxgate:deployment_errors",
            "failed attempts by kind (unavailable: connection "
            "or 5xx before the first token, timeout, overloaded: at its parallel limit or "
            "429/503, stream: cut after tokens flowed)",
            [*labels, "kind"],
            registry=r,
        )
        self.ejections = Counter(
            "ctxgate:deployment_ejections",
            "times the deployment was ejected (failures in a row or a failed health probe)",
            labels,
            registry=r,
        )
        self.affinity_hits = Counter(
            "ctxgate:deployment_affinity_hits",
            "cache-affinity requests served by the "
            "deployment expected to hold their prefix (last served the key, else its ring owner)",
            labels,
            registry=r,
        )
        self.fallbacks = Counter(
            "ctxgate:model_fallbacks",
            "requests a model group could not take, sent to a fallback model",
            ["model", "fallback"],
            registry=r,
        )

    def watch(self, states: Callable[[], Iterable[DeploymentState]]) -> None:
        self.registry.register(_Live(states))

    def declare(self, model: str, deployment: str) -> None:
        """Series exist from the start, so rates work before the first event."""
        self.ttft.labels(model, deployment)
        self.requests.labels(model, deployment)
        self.ejections.labels(model, deployment)
        self.affinity_hits.labels(model, deployment)
        for kind in ERROR_KINDS:
            self.errors.labels(model, deployment, kind)
