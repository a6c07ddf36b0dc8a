"""What a refusal says: the limit, what is used, what the request needs and when there is room again."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ctxgate.gateway.quota.model import SLIDING, SPEND_SCALE, LimitUsage, Meter, QuotaExceeded, Reading

if TYPE_CHECKING:
    from ctxgate.gateway.quota.rate_limits import RateLimitState


def go_duration(seconds: int) -> str:
    """Whole seconds as OpenAI writes a rate-limit reset (Go's time.Duration): "1s", "6m0s", "1h2m3s"."""
    hours, rest = divmod(max(0, seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


_WINDOW_OF = {
    "minute": "a minute",
    "day": "a day",
    "week": "a week",
    "month": "a month",
    "daily": "this budget period",
    "weekly": "this budget period",
    "monthly": "this budget period",
}


def exceeded(
    meter: Meter, reading: Reading, wait_s: int, now: float, rate_limits: RateLimitState | None = None
) -> QuotaExceeded:
    """The refusal a store raises when `meter` (as `reading` found it) has no room for the request
    for `wait_s` seconds; the message states the limit, what is used, and when there is room."""
    usage = LimitUsage.of(meter, Reading(reading.level, wait_s), now)
    if meter.unit == "slots":
        message = f"{meter.scope} already has {meter.limit} requests in flight (max_parallel_requests)"
        return QuotaExceeded(meter.reason, wait_s, message, rate_limits, usage)

    def amount(value: int) -> str:
        return f"{value / SPEND_SCALE:g}" if meter.unit == "spend" else f"{value}"

    unit = "" if meter.unit == "spend" else f" {meter.unit}"
    if meter.kind == SLIDING:
        window, when = "in the last 60 s", "the limit has room for it in"
    else:
        window, when = _WINDOW_OF.get(meter.period, "this window"), "the limit resets in"
    message = (
        f"{meter.scope} is over its {meter.reason} quota: {amount(reading.level)} of {amount(meter.limit)}{unit} "
        f"{window} used, this request needs {amount(meter.amount)}; {when} {go_duration(wait_s)} "
        f"({usage.resets_at})"
    )
    return QuotaExceeded(meter.reason, wait_s, message, rate_limits, usage)
