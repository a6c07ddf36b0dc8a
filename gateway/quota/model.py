"""The quota model: limits, meters, readings and reservations. Pure: no I/O, no clock of its own.

Invariants the stores rely on:

- A meter's window is a function of `now` (and its quota's time zone) only: the per-minute limits
  slide (`ctxgate.gateway.quota.sliding`) or are fixed epoch minutes (`window: fixed`); the day,
  week and month ones are calendar windows in the quota's zone (`ctxgate.gateway.quota.calendar`).
  Every replica given the same time computes the same keys.
- The ledger identity is the tenant (and, for a key's own limits, the key's `quota_id`; for a limit
  per model, the model's name under either), never the policy a request runs under: a policy changes
  the limits a reservation is checked against, not the counters it draws on. Every key of a tenant
  shares one `{tenant}` hash tag.
- A reservation is checked against every meter and applied to all or none.
- A reservation is reconciled at most once (`reconcile_deltas` marks it), so a held parallel slot
  is released exactly once and a late second settle changes nothing.
- Spend is integer micro-units of the currency (`SPEND_SCALE`): stores never add floats.

Which meters a request touches is `ctxgate.gateway.quota.meters`; what a refusal says is
`ctxgate.gateway.quota.refusal`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ctxgate.gateway.quota.calendar import iso_time
from ctxgate.policies.schema import QuotaPolicy

if TYPE_CHECKING:
    from ctxgate.gateway.quota.rate_limits import RateLimitState

SPEND_SCALE = 1_000_000  # spend is stored in micro-units of the currency: integer arithmetic only
NO_LIMIT = -1
# A held parallel slot outlives a request that was never settled (its replica died) by at most this.
DEFAULT_SLOT_TTL_S = 900
WINDOWS = ("sliding", "fixed")

COUNTER, SLOT_CHECK, SLOT_HOLD, SLIDING = 0, 1, 2, 3  # meter kinds, as the Lua scripts know them

_NUMERIC_LIMITS = (
    "requests_per_minute",
    "tokens_per_minute",
    "tokens_per_day",
    "tokens_per_week",
    "tokens_per_month",
    "spend_per_day",
    "max_parallel_requests",
    "budget",
)
# Where a quota's window shape and zone come from when a key's or a model's limits leave them unset.
INHERITED = ("window", "time_zone")


@dataclass(frozen=True)
class QuotaLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    tokens_per_week: int | None = None
    tokens_per_month: int | None = None
    spend_per_day: float | None = None
    max_parallel_requests: int | None = None
    budget: float | None = None
    budget_period: str = "monthly"
    on_store_error: str = "allow"
    window: str = "sliding"  # the per-minute limits: sliding (any 60 s) or fixed (epoch minutes)
    time_zone: str = "UTC"  # where days, weeks and months begin (IANA name)
    # Limits per served model name, on top of these (their window and zone default to these).
    models: Mapping[str, QuotaLimits] = field(default_factory=dict)

    @classmethod
    def from_policy(cls, quota: QuotaPolicy, override: dict[str, Any] | None = None) -> QuotaLimits:
        values = quota.model_dump()
        values.update(override or {})
        return cls.from_mapping(values)

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, Any] | None, inherit: QuotaLimits | None = None
    ) -> QuotaLimits:
        """Limits from a mapping (a keys file's or a policy's fields); `inherit`: the owner whose window
        shape and time zone apply where `values` sets none (a key's own limits, a model's)."""
        values = {name: value for name, value in (values or {}).items() if value is not None}
        if inherit is not None:
            values = {name: getattr(inherit, name) for name in INHERITED} | values
        fields = {name: values[name] for name in cls.__dataclass_fields__ if name in values}
        own = cls(**(fields | {"models": {}}))
        fields["models"] = {
            name: cls.from_mapping(model_values, inherit=own)
            for name, model_values in (values.get("models") or {}).items()
        }
        return cls(**fields)

    def tightened_by(self, cap: QuotaLimits) -> QuotaLimits:
        """These limits, where `cap` can only make them stricter: per field the smaller of two set
        limits (an unset one is no limit), `deny` over `allow` when the store is down. A budget
        keeps its own period; `cap`'s applies only where this has none. The window shape, the time
        zone and the limits per model stay these: they decide which counters the tenant draws on,
        and a request's policy must not move it onto other ones."""
        values: dict[str, Any] = {}
        for name in _NUMERIC_LIMITS:
            mine, theirs = getattr(self, name), getattr(cap, name)
            values[name] = theirs if mine is None else mine if theirs is None else min(mine, theirs)
        values["budget_period"] = self.budget_period if self.budget is not None else cap.budget_period
        values["on_store_error"] = "deny" if "deny" in (self.on_store_error, cap.on_store_error) else "allow"
        return QuotaLimits(**values, window=self.window, time_zone=self.time_zone, models=self.models)

    @property
    def own_unlimited(self) -> bool:
        """No limit of its own (limits per model aside)."""
        return all(getattr(self, name) is None for name in _NUMERIC_LIMITS)

    @property
    def unlimited(self) -> bool:
        return self.own_unlimited and all(limits.unlimited for limits in self.models.values())

    def spend_limit_micros(self) -> int | None:
        return None if self.spend_per_day is None else int(round(self.spend_per_day * SPEND_SCALE))

    def budget_micros(self) -> int | None:
        return None if self.budget is None else int(round(self.budget * SPEND_SCALE))


@dataclass(frozen=True)
class Meter:
    """One limit a reservation is checked against: a counter in a window, a sliding window's
    buckets, or a parallel-slot set."""

    key: str
    limit: int  # NO_LIMIT: counted but never refuses
    amount: int
    ttl_s: int
    reason: str  # the limit's name: requests_per_minute, tokens_per_month, budget, ...
    scope: str  # who the limit belongs to, for messages: "tenant 'acme'" or "API key 'ab12cd34ef56'"
    unit: str  # requests | tokens | spend | slots
    retry_after_s: int  # a fixed or calendar window: until it ends (a sliding one: the store reads it)
    kind: int = COUNTER
    owner: str = "tenant"  # tenant | key
    model: str | None = None  # a limit per model: its served name
    period: str = "minute"  # minute | day | week | month | slots
    bucket: int = 0  # SLIDING: this reservation's bucket (its reconcile credits that one)
    ends_at: float | None = None  # a fixed or calendar window: its end (epoch s); else now + the reset
    time_zone: str = "UTC"


@dataclass(frozen=True)
class Reading:
    """What a store read of one meter: its level (counter, sliding sum, or slots held) and the
    seconds until its window resets (a fixed window's end; a sliding window's emptying)."""

    level: int
    reset_s: int


@dataclass(frozen=True)
class LimitUsage:
    """One limit as a store left it: for `usage.ctxgate.quota`, a 429's body and `ctxgate keys`."""

    name: str
    owner: str
    model: str | None
    unit: str
    limit: int
    used: int
    reset_s: int
    resets_at: str  # ISO 8601, in the limit's time zone

    @classmethod
    def of(cls, meter: Meter, reading: Reading, now: float) -> LimitUsage:
        return cls(
            meter.reason,
            meter.owner,
            meter.model,
            meter.unit,
            meter.limit,
            reading.level,
            reading.reset_s,
            iso_time(_reset_moment(meter, reading, now), meter.time_zone),
        )

    def report(self) -> dict[str, Any]:
        """The JSON shape (spend in the currency's units, not micro-units)."""

        def shown(value: int) -> float | int:
            return value / SPEND_SCALE if self.unit == "spend" else value

        return {
            "limit": self.name,
            "scope": self.owner,
            "model": self.model,
            "unit": self.unit,
            "max": shown(self.limit),
            "used": shown(self.used),
            "remaining": shown(max(0, self.limit - self.used)),
            "reset_s": self.reset_s,
            "resets_at": self.resets_at,
        }


class QuotaExceeded(Exception):
    def __init__(
        self,
        reason: str,
        retry_after_s: int,
        message: str,
        rate_limits: RateLimitState | None = None,
        usage: LimitUsage | None = None,
    ):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = max(1, retry_after_s)
        # The request and token limits as the store read them when it refused (the 429's headers).
        self.rate_limits = rate_limits
        # The limit that refused, as read (the 429 body's `quota`); None for a request too large for it.
        self.usage = usage


class StoreUnavailable(Exception):
    """The quota store cannot be reached; the policy's `on_store_error` decides what happens."""


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
    # Every limit after this reservation (`usage.ctxgate.quota`).
    usage: tuple[LimitUsage, ...] = ()


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


def has_room(meter: Meter, level: int) -> bool:
    """Whether `meter`, at `level`, can take the request's amount (a slot set: one more slot)."""
    if meter.kind in (SLOT_CHECK, SLOT_HOLD):
        return level + 1 <= meter.limit
    return meter.limit == NO_LIMIT or level + meter.amount <= meter.limit


def usage_of(meters: list[Meter], readings: list[Reading], now: float) -> tuple[LimitUsage, ...]:
    """Every limit among `meters`, as read (parallel slots included)."""
    return tuple(
        LimitUsage.of(meter, reading, now)
        for meter, reading in zip(meters, readings, strict=True)
        if meter.limit != NO_LIMIT
    )


def _reset_moment(meter: Meter, reading: Reading, now: float) -> float:
    """When the reading's reset falls: a window's exact end where the reset is that end (the seconds
    are rounded up), else `now` plus the reset."""
    if meter.ends_at is not None and reading.reset_s == meter.retry_after_s:
        return meter.ends_at
    return now + reading.reset_s
