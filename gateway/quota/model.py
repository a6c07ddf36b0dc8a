"""The quota model: limits, windows, meters and reservations. Pure: no I/O, no clock of its own.

Invariants the stores rely on:

- Windows are fixed and aligned to the epoch (minute, UTC day, ISO week, calendar month) and are a
  function of `now` only, so every replica given the same time computes the same window keys.
- The ledger identity is the tenant (and, for a key's own limits, the key's `quota_id`), never the
  policy a request runs under: a policy changes the limits a reservation is checked against, not
  the counters it draws on. Every key of a tenant shares one `{tenant}` hash tag.
- A reservation is checked against every meter and applied to all or none.
- A reservation is reconciled at most once (`reconcile_deltas` marks it), so a held parallel slot
  is released exactly once and a late second settle changes nothing.
- Spend is integer micro-units of the currency (`SPEND_SCALE`): stores never add floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ctxgate.policies.schema import QuotaPolicy

if TYPE_CHECKING:
    from ctxgate.gateway.quota.rate_limits import RateLimitState

MINUTE_S = 60
DAY_S = 86400
WEEK_S = 7 * DAY_S
SPEND_SCALE = 1_000_000  # spend is stored in micro-units of the currency: integer arithmetic only
NO_LIMIT = -1
BUDGET_PERIODS = ("daily", "weekly", "monthly")
# A held parallel slot outlives a request that was never settled (its replica died) by at most this.
DEFAULT_SLOT_TTL_S = 900

COUNTER, SLOT_CHECK, SLOT_HOLD = 0, 1, 2  # meter kinds, as the Lua scripts know them

USAGE_NAMES = ("requests_this_minute", "tokens_this_minute", "tokens_today", "spend_micros_today")


@dataclass(frozen=True)
class QuotaLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    spend_per_day: float | None = None
    max_parallel_requests: int | None = None
    budget: float | None = None
    budget_period: str = "monthly"
    on_store_error: str = "allow"

    @classmethod
    def from_policy(cls, quota: QuotaPolicy, override: dict[str, Any] | None = None) -> QuotaLimits:
        values = quota.model_dump()
        values.update(override or {})
        return cls.from_mapping(values)

    @classmethod
    def from_mapping(cls, values: dict[str, Any] | None) -> QuotaLimits:
        values = {name: value for name, value in (values or {}).items() if value is not None}
        return cls(**{name: values[name] for name in cls.__dataclass_fields__ if name in values})

    def tightened_by(self, cap: QuotaLimits) -> QuotaLimits:
        """These limits, where `cap` can only make them stricter: per field the smaller of two set
        limits (an unset one is no limit), `deny` over `allow` when the store is down. A budget
        keeps its own period; `cap`'s applies only where this has none."""
        values: dict[str, Any] = {}
        for name in _NUMERIC_LIMITS:
            mine, theirs = getattr(self, name), getattr(cap, name)
            values[name] = theirs if mine is None else mine if theirs is None else min(mine, theirs)
        values["budget_period"] = self.budget_period if self.budget is not None else cap.budget_period
        values["on_store_error"] = "deny" if "deny" in (self.on_store_error, cap.on_store_error) else "allow"
        return QuotaLimits(**values)

    @property
    def unlimited(self) -> bool:
        return all(
            limit is None
            for limit in (
                self.requests_per_minute,
                self.tokens_per_minute,
                self.tokens_per_day,
                self.spend_per_day,
                self.max_parallel_requests,
                self.budget,
            )
        )

    def spend_limit_micros(self) -> int | None:
        return None if self.spend_per_day is None else int(round(self.spend_per_day * SPEND_SCALE))

    def budget_micros(self) -> int | None:
        return None if self.budget is None else int(round(self.budget * SPEND_SCALE))


_NUMERIC_LIMITS = (
    "requests_per_minute",
    "tokens_per_minute",
    "tokens_per_day",
    "spend_per_day",
    "max_parallel_requests",
    "budget",
)


class QuotaExceeded(Exception):
    def __init__(
        self, reason: str, retry_after_s: int, message: str, rate_limits: RateLimitState | None = None
    ):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = max(1, retry_after_s)
        # The request and token limits as the store read them when it refused (the 429's headers).
        self.rate_limits = rate_limits


class StoreUnavailable(Exception):
    """The quota store cannot be reached; the policy's `on_store_error` decides what happens."""


@dataclass
class Windows:
    minute: int
    day: int
    seconds_to_minute_end: int
    seconds_to_day_end: int
    week: int = 0
    month: int = 0
    seconds_to_week_end: int = 0
    seconds_to_month_end: int = 0

    @classmethod
    def at(cls, now: float) -> Windows:
        # Epoch day 0 was a Thursday: shifting by 3 days makes weeks start on Monday (ISO).
        shifted = now + 3 * DAY_S
        moment = datetime.fromtimestamp(now, UTC)
        next_month = datetime(moment.year + moment.month // 12, moment.month % 12 + 1, 1, tzinfo=UTC)
        return cls(
            minute=int(now // MINUTE_S),
            day=int(now // DAY_S),
            seconds_to_minute_end=math.ceil(MINUTE_S - now % MINUTE_S),
            seconds_to_day_end=math.ceil(DAY_S - now % DAY_S),
            week=int(shifted // WEEK_S),
            month=moment.year * 12 + moment.month - 1,
            seconds_to_week_end=math.ceil(WEEK_S - shifted % WEEK_S),
            seconds_to_month_end=math.ceil(next_month.timestamp() - now),
        )

    def budget_window(self, period: str) -> tuple[int, int]:
        """(window number, seconds to its end) for a budget period."""
        if period == "daily":
            return self.day, self.seconds_to_day_end
        if period == "weekly":
            return self.week, self.seconds_to_week_end
        if period == "monthly":
            return self.month, self.seconds_to_month_end
        raise ValueError(f"unknown budget period '{period}' (use one of {', '.join(BUDGET_PERIODS)})")


@dataclass(frozen=True)
class Meter:
    """One limit a reservation is checked against: a counter in a window, or a parallel-slot set."""

    key: str
    limit: int  # NO_LIMIT: counted (for usage) but never refuses
    amount: int
    ttl_s: int
    reason: str
    scope: str  # who the limit belongs to, for messages: "tenant 'acme'" or "API key 'ab12cd34ef56'"
    unit: str  # requests | tokens | spend | slots
    retry_after_s: int
    kind: int = COUNTER


@dataclass
class Reservation:
    tenant: str
    tokens: int
    spend_micros: int
    meters: tuple[Meter, ...] = ()
    # False when nothing was recorded: no limits, or the store was down and the request was let
    # through (on_store_error: allow). There is nothing to reconcile then.
    recorded: bool = True
    reconciled: bool = field(default=False)
    slot_id: str | None = None
    # What the request and token limits have left after this reservation (the response's headers).
    rate_limits: RateLimitState | None = None


def _tenant_prefix(tenant: str) -> str:
    # The {tenant} hash tag keeps a tenant's keys (its API keys' too) in one Redis Cluster slot,
    # which a Lua script touching both needs.
    return f"ctxgate:quota:{{{tenant}}}"


def _meters(
    prefix: str,
    scope: str,
    limits: QuotaLimits,
    tokens: int,
    spend_micros: int,
    windows: Windows,
    slot: int,
    always_count: bool,
) -> list[Meter]:
    """The meters of one scope. `always_count`: also count unlimited windows (the tenant's usage)."""
    counted = [
        (
            "requests_per_minute",
            limits.requests_per_minute,
            1,
            f"rpm:{windows.minute}",
            MINUTE_S * 2,
            windows.seconds_to_minute_end,
            "requests",
        ),
        (
            "tokens_per_minute",
            limits.tokens_per_minute,
            tokens,
            f"tpm:{windows.minute}",
            MINUTE_S * 2,
            windows.seconds_to_minute_end,
            "tokens",
        ),
        (
            "tokens_per_day",
            limits.tokens_per_day,
            tokens,
            f"tpd:{windows.day}",
            DAY_S * 2,
            windows.seconds_to_day_end,
            "tokens",
        ),
        (
            "spend_per_day",
            limits.spend_limit_micros(),
            spend_micros,
            f"spd:{windows.day}",
            DAY_S * 2,
            windows.seconds_to_day_end,
            "spend",
        ),
    ]
    meters = [
        Meter(
            f"{prefix}:{suffix}",
            NO_LIMIT if limit is None else int(limit),
            amount,
            ttl,
            reason,
            scope,
            unit,
            retry,
        )
        for reason, limit, amount, suffix, ttl, retry, unit in counted
        if always_count or limit is not None
    ]
    if limits.budget is not None:
        window, remaining = windows.budget_window(limits.budget_period)
        meters.append(
            Meter(
                f"{prefix}:budget:{limits.budget_period}:{window}",
                limits.budget_micros(),
                spend_micros,
                remaining + DAY_S,
                "budget",
                scope,
                "spend",
                remaining,
            )
        )
    if limits.max_parallel_requests is not None:
        meters.append(
            Meter(
                f"{prefix}:parallel",
                limits.max_parallel_requests,
                1,
                DEFAULT_SLOT_TTL_S,
                "max_parallel_requests",
                scope,
                "slots",
                1,
                kind=slot,
            )
        )
    return meters


def build_meters(
    tenant: str,
    limits: QuotaLimits,
    tokens: int,
    spend_micros: int,
    now: float,
    key_id: str | None = None,
    key_limits: QuotaLimits | None = None,
    hold_slot: bool = False,
) -> list[Meter]:
    """Every meter one request touches: the tenant's, then its API key's (when the key has limits)."""
    windows = Windows.at(now)
    slot = SLOT_HOLD if hold_slot else SLOT_CHECK
    prefix = _tenant_prefix(tenant)
    meters = []
    if not limits.unlimited:
        meters = _meters(prefix, f"tenant '{tenant}'", limits, tokens, spend_micros, windows, slot, True)
    if key_id is not None and key_limits is not None and not key_limits.unlimited:
        meters += _meters(
            f"{prefix}:key:{key_id}",
            f"API key '{key_id}'",
            key_limits,
            tokens,
            spend_micros,
            windows,
            slot,
            False,
        )
    return meters


def _check_fits_at_all(meters: list[Meter]) -> None:
    """A request larger than a whole window's allowance can never pass: say so instead of waiting."""
    for meter in meters:
        if meter.unit in ("tokens", "spend") and meter.limit != NO_LIMIT and meter.amount > meter.limit:
            unit = " micro-units" if meter.unit == "spend" else " tokens"
            owner = "the tenant's" if meter.scope.startswith("tenant") else "the API key's"
            raise QuotaExceeded(
                meter.reason,
                meter.retry_after_s,
                f"this request alone needs more than {owner} {meter.reason} quota ({meter.amount} > {meter.limit}"
                f"{unit}); lower max_tokens or the prompt",
            )


def plan_reservation(
    tenant: str,
    limits: QuotaLimits,
    tokens: int,
    spend_micros: int,
    now: float,
    key_id: str | None,
    key_limits: QuotaLimits | None,
    slot_id: str | None,
) -> list[Meter]:
    """The meters a store checks and applies for one request at `now`; raises QuotaExceeded at once
    for a request that could not fit in an empty window. `slot_id`: hold a parallel slot under it."""
    meters = build_meters(
        tenant, limits, tokens, spend_micros, now, key_id, key_limits, hold_slot=slot_id is not None
    )
    _check_fits_at_all(meters)
    return meters


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
    "requests_per_minute": "a minute",
    "tokens_per_minute": "a minute",
    "tokens_per_day": "a day",
    "spend_per_day": "a day",
    "budget": "this budget period",
}


def exceeded(meter: Meter, level: int, rate_limits: RateLimitState | None = None) -> QuotaExceeded:
    """The refusal a store raises when `meter` (at `level`: its counter, or the slots held) has no
    room left; the message states the limit, what is used, and when the window resets."""
    if meter.unit == "slots":
        message = f"{meter.scope} already has {meter.limit} requests in flight (max_parallel_requests)"
        return QuotaExceeded(meter.reason, meter.retry_after_s, message, rate_limits)

    def amount(value: int) -> str:
        return f"{value / SPEND_SCALE:g}" if meter.unit == "spend" else f"{value}"

    unit = "" if meter.unit == "spend" else f" {meter.unit}"
    message = (
        f"{meter.scope} is over its {meter.reason} quota: {amount(level)} of {amount(meter.limit)}{unit} "
        f"{_WINDOW_OF.get(meter.reason, 'this window')} used, this request needs {amount(meter.amount)}; "
        f"the limit resets in {go_duration(meter.retry_after_s)}"
    )
    return QuotaExceeded(meter.reason, meter.retry_after_s, message, rate_limits)


def usage_keys(tenant: str, now: float) -> list[str]:
    """The tenant's counters at `now`, in the order of `USAGE_NAMES`."""
    windows = Windows.at(now)
    prefix = _tenant_prefix(tenant)
    return [
        f"{prefix}:rpm:{windows.minute}",
        f"{prefix}:tpm:{windows.minute}",
        f"{prefix}:tpd:{windows.day}",
        f"{prefix}:spd:{windows.day}",
    ]


def reconcile_deltas(
    reservation: Reservation, actual_tokens: int, actual_spend_micros: int
) -> list[tuple[Meter, int]]:
    """(meter, delta) for every token, spend and held-slot meter; empty if nothing to reconcile.

    Marks the reservation reconciled, so a second call for the same request is a no-op (and a held
    parallel slot is released exactly once).
    """
    if not reservation.recorded or reservation.reconciled:
        return []
    reservation.reconciled = True
    token_delta = actual_tokens - reservation.tokens
    spend_delta = actual_spend_micros - reservation.spend_micros
    deltas = []
    for meter in reservation.meters:
        if meter.kind == SLOT_HOLD:
            deltas.append((meter, 0))
        elif meter.unit == "tokens":
            deltas.append((meter, token_delta))
        elif meter.unit == "spend":
            deltas.append((meter, spend_delta))
    return deltas
