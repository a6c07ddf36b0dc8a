"""What a tenant's limits leave after a reservation, as OpenAI's rate-limit headers.

`x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` and the
`-tokens` trio, with OpenAI's conventions: the limit and what remains as integers, the reset as a Go
duration ("35s", "6m0s", "23h59m5s") until the window that binds resets (a sliding window: until it
is empty again). ctxgate adds the same trio for spend (`-spend`: per-day spend limits and budgets,
in the currency's units). Where several limits count the same unit (the tenant's, its API key's,
per model, per minute, day, week and month), the headers show the one with the least left: the limit
the next request meets first. Parallel slots get no header; a tenant without such limits gets none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ctxgate.gateway.quota.model import COUNTER, NO_LIMIT, SLIDING, SPEND_SCALE, Meter, Reading
from ctxgate.gateway.quota.refusal import go_duration

UNITS = ("requests", "tokens", "spend")


@dataclass(frozen=True)
class RateLimit:
    limit: int
    remaining: int
    reset_s: int


@dataclass(frozen=True)
class RateLimitState:
    """The binding request, token and spend limit of one request, as the store left them."""

    requests: RateLimit | None = None
    tokens: RateLimit | None = None
    spend: RateLimit | None = None  # in micro-units

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        for unit, state in (("requests", self.requests), ("tokens", self.tokens), ("spend", self.spend)):
            if state is not None:
                headers[f"x-ratelimit-limit-{unit}"] = _shown(unit, state.limit)
                headers[f"x-ratelimit-remaining-{unit}"] = _shown(unit, state.remaining)
                headers[f"x-ratelimit-reset-{unit}"] = go_duration(state.reset_s)
        return headers


def _shown(unit: str, value: int) -> str:
    return f"{value / SPEND_SCALE:g}" if unit == "spend" else str(value)


def rate_limit_state(meters: Sequence[Meter], readings: Sequence[Reading]) -> RateLimitState | None:
    """The binding request, token and spend limits, given each meter's reading as the store read or
    left it; None when no meter limits any of them."""
    tightest: dict[str, RateLimit] = {}
    for meter, reading in zip(meters, readings, strict=True):
        if meter.kind not in (COUNTER, SLIDING) or meter.limit == NO_LIMIT or meter.unit not in UNITS:
            continue
        state = RateLimit(meter.limit, max(0, meter.limit - reading.level), reading.reset_s)
        known = tightest.get(meter.unit)
        if known is None or (state.remaining, state.reset_s) < (known.remaining, known.reset_s):
            tightest[meter.unit] = state
    if not tightest:
        return None
    return RateLimitState(**tightest)
