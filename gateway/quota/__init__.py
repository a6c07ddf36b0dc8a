"""Quotas per tenant and per API key: reserve before the model call, reconcile with the real count after.

- `ctxgate.gateway.quota.model`: limits, windows, meters, reservations (pure; no I/O, no clock).
- `ctxgate.gateway.quota.store`: the `QuotaStore` protocol every ledger follows, the `Clock`.
- `ctxgate.gateway.quota.memory`: one process's ledger.
- `ctxgate.gateway.quota.redis_store`: the ledger replicas share (atomic Lua scripts).

A reservation touches a list of meters (the tenant's and, when the key has limits of its own, the
key's); it is admitted only if it fits under every limit. Parallel-request limits are sets of
(request id, deadline): a slot is released when the request is settled, and a slot whose replica
died expires by itself at its deadline instead of leaking.
"""

from __future__ import annotations

import time

from ctxgate.gateway.quota.memory import InProcessQuotaStore
from ctxgate.gateway.quota.model import (
    BUDGET_PERIODS,
    DEFAULT_SLOT_TTL_S,
    SPEND_SCALE,
    Meter,
    QuotaExceeded,
    QuotaLimits,
    Reservation,
    StoreUnavailable,
    Windows,
    build_meters,
)
from ctxgate.gateway.quota.rate_limits import RateLimit, RateLimitState
from ctxgate.gateway.quota.redis_store import RedisQuotaStore
from ctxgate.gateway.quota.store import Clock, QuotaStore

__all__ = [
    "BUDGET_PERIODS",
    "DEFAULT_SLOT_TTL_S",
    "SPEND_SCALE",
    "Clock",
    "InProcessQuotaStore",
    "Meter",
    "QuotaExceeded",
    "QuotaLimits",
    "QuotaStore",
    "RateLimit",
    "RateLimitState",
    "RedisQuotaStore",
    "Reservation",
    "StoreUnavailable",
    "Windows",
    "build_meters",
    "create_store",
]


def create_store(redis_url: str | None, clock: Clock = time.time) -> QuotaStore:
    """The Redis ledger when a URL is configured (replicas share it), else this process's own."""
    return RedisQuotaStore(redis_url, clock=clock) if redis_url else InProcessQuotaStore(clock=clock)
