"""What a tenant's request and token limits leave after a reservation, as OpenAI's rate-limit headers.

`x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` and the
`-tokens` trio, with OpenAI's conventions: the limit and what remains as integers, the reset as a Go
duration ("35s", "6m0s", "23h59m5s") until the window that binds ends. Where several limits count the
same unit (the tenant's and its API key's, per minute and per day), the headers show the one with the
least left: the limit the next request meets first. Spend, budgets and parallel slots have no header
in OpenAI's convention and get none here; a tenant without request or token limits gets no headers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ctxgate.gateway.quota.model import COUNTER, NO_LIMIT, Meter, go_duration


@dataclass(frozen=True)
class RateLimit:
    limit: int
    remaining: int
    reset_s: int


@dataclass(frozen=True)
class RateLimitState:
    """The binding request limit and token limit of one request, as the store left them."""

    requests: RateLimit | None = None
    tokens: RateLimit | None = None

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        for unit, state in (("requests", self.requests), ("tokens", self.tokens)):
            if state is not None:
                headers[f"x-ratelimit-limit-{unit}"] = str(state.limit)
                headers[f"x-ratelimit-remaining-{unit}"] = str(state.remaining)
                headers[f"x-ratelimit-reset-{unit}"] = go_duration(state.reset_s)
        return headers


def rate_limit_state(meters: Sequence[Meter], levels: Sequence[int]) -> RateLimitState | None:
    """The binding request and token limits, given each meter's level (its counter's value, or the
    slots held) as the store read or left it; None when no meter limits requests or tokens."""
    tightest: dict[str, RateLimit] = {}
    for meter, level in zip(meters, levels, strict=True):
        if meter.kind != COUNTER or meter.limit == NO_LIMIT or meter.unit not in ("requests", "tokens"):
            continue
        state = RateLimit(meter.limit, max(0, meter.limit - int(level)), meter.retry_after_s)
        known = tightest.get(meter.unit)
        if known is None or (state.remaining, state.reset_s) < (known.remaining, known.reset_s):
            tightest[meter.unit] = state
    if not tightest:
        return None
    return RateLimitState(requests=tightest.get("requests"), tokens=tightest.get("tokens"))
