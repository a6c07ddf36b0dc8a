"""How many tokens (or how much spend) a tenant can still reserve now: the room compress-to-fit
admission (`ctxgate.gateway.fit`) fits a request into.

The room is the smallest of (limit - used) over every token counter a reservation would touch (the
tenant's per-minute, day, week and month windows, its limits for the model, and its API key's when
the key has limits of its own). Reading it reserves nothing: the exact reservation afterwards is
still the atomic decision, so two requests fitted into the same room cannot both be admitted.
"""

from __future__ import annotations

from ctxgate.gateway.quota.meters import build_meters
from ctxgate.gateway.quota.model import COUNTER, NO_LIMIT, SLIDING, Meter, QuotaLimits


def token_meters(
    tenant: str,
    limits: QuotaLimits,
    now: float,
    key_id: str | None,
    key_limits: QuotaLimits | None,
    model: str | None = None,
    unit: str = "tokens",
) -> list[Meter]:
    """The limited counters of `unit` (tokens, or spend) a reservation at `now` would be checked against."""
    meters = build_meters(tenant, limits, 0, 0, now, key_id, key_limits, model=model)
    return [m for m in meters if m.kind in (COUNTER, SLIDING) and m.unit == unit and m.limit != NO_LIMIT]


def room_left(meters: list[Meter], used: list[int]) -> int | None:
    """min(limit - used) over `meters` (never below 0); None when no token limit applies."""
    if not meters:
        return None
    return max(0, min(meter.limit - count for meter, count in zip(meters, used, strict=True)))
