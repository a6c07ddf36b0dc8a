"""The engine as the console shows it: admission (in flight, queued), the engine's queue, running
sequences and KV use, TTFT/TPOT percentiles from the gateway's histograms, the adaptive budgets in
force."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from ctxgate.gateway.admission import AdmissionStats
from ctxgate.gateway.budget_control import BudgetController

TTFT = "ctxgate:gateway_ttft_seconds"
TPOT = "ctxgate:gateway_tpot_seconds"
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Percentiles:
    count: int
    values: dict[float, float | None]  # quantile -> seconds; None: no observation yet


@dataclass(frozen=True)
class EngineView:
    admission: AdmissionStats
    waiting_tokens: int
    running: int
    kv_usage: float
    prefill_tokens_per_s: float | None
    ttft: Percentiles
    tpot: Percentiles
    budgets: dict[str, int]


def histogram_buckets(registry: CollectorRegistry, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of an unlabelled histogram, by bound."""
    buckets = []
    for family in registry.collect():
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
    return sorted(buckets)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket the rank falls in; the highest finite
    bound when it falls in the +Inf bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def percentiles(registry: CollectorRegistry, name: str) -> Percentiles:
    buckets = histogram_buckets(registry, name)
    count = int(buckets[-1][1]) if buckets else 0
    return Percentiles(count, {q: quantile(q, buckets) for q in QUANTILES})


def engine_view(
    registry: CollectorRegistry, admission: AdmissionStats, budgets: BudgetController
) -> EngineView:
    load = budgets.load()
    return EngineView(
        admission=admission,
        waiting_tokens=load.waiting_tokens,
        running=load.running,
        kv_usage=load.kv_usage,
        prefill_tokens_per_s=load.prefill_tokens_per_s,
        ttft=percentiles(registry, TTFT),
        tpot=percentiles(registry, TPOT),
        budgets=budgets.budgets_in_force(),
    )
