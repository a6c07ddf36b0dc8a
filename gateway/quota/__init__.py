"""Quotas per tenant, per API key and per model: reserve before the model call, reconcile after.

- `ctxgate.gateway.quota.model`: limits, meters, readings, reservations (pure; no I/O, no clock).
- `ctxgate.gateway.quota.meters`: which meters one request touches, and their ledger keys.
- `ctxgate.gateway.quota.sliding`: the per-minute limits' sliding window (any 60 s holds at most
  the limit); `ctxgate.gateway.quota.calendar`: days, weeks and months in a time zone.
- `ctxgate.gateway.quota.refusal`, `rate_limits`, `room`: what a refusal says, the `x-ratelimit-*`
  headers, the tokens left for compress-to-fit.
- `ctxgate.gateway.quota.store`: the `QuotaStore` protocol every ledger follows, the `Clock`.
- `ctxgate.gateway.quota.memory`: one process's ledger.
- `ctxgate.gateway.quota.redis_store`: the ledger replicas share (atomic Lua scripts, `redis_lua`).

A reservation touches a list of meters (the tenant's; the key's when the key has limits of its own;
either's limits for the model requested); it is admitted only if it fits under every limit, and then
applied to all of them. Parallel-request limits are sets of (request id, deadline): a slot is
released when the request is settled, and a slot whose replica died expires by itself at its
deadline instead of leaking.
"""

from __future__ import annotations

import time

from ctxgate.gateway.quota.calendar import BUDGET_PERIODS, check_time_zone
from ctxgate.gateway.quota.memory import InProcessQuotaStore
from ctxgate.gateway.quota.meters import build_meters
from ctxgate.gateway.quota.model import (
    DEFAULT_SLOT_TTL_S,
    SPEND_SCALE,
    WINDOWS,
    LimitUsage,
    Meter,
    QuotaExceeded,
    QuotaLimits,
    Reservation,
    StoreUnavailable,
)
from ctxgate.gateway.quota.rate_limits import RateLimit, RateLimitState
from ctxgate.gateway.quota.redis_store import RedisQuotaStore
from ctxgate.gateway.quota.store import Clock, QuotaStore

__all__ = [
    "BUDGET_PERIODS",
    "DEFAULT_SLOT_TTL_S",
    "SPEND_SCALE",
    "WINDOWS",
    "Clock",
    "InProcessQuotaStore",
    "LimitUsage",
    "Meter",
    "QuotaExceeded",
    "QuotaLimits",
    "QuotaStore",
    "RateLimit",
    "RateLimitState",
    "RedisQuotaStore",
    "Reservation",
    "StoreUnavailable",
    "build_meters",
    "check_time_zone",
    "create_store",
]


def create_store(redis_url: str | None, clock: Clock = time.time) -> QuotaStore:
    """The Redis ledger when a URL is configured (replicas share it), else this process's own."""
    return RedisQuotaStore(redis_url, clock=clock) if redis_url else InProcessQuotaStore(clock=clock)
