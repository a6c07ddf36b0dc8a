"""Which meters one request touches: its tenant's limits, its API key's (when the key has limits of
its own), and either's limits for the model the request names. A store checks every meter and
applies all of them or none.

Keys (one `{tenant}` hash tag, so a Lua script may touch them all in a Redis Cluster):
`ctxgate:quota:{tenant}[:key:ID][:model:NAME]:` then `rpm` / `tpm` (a sliding window's buckets),
`rpm:MINUTE` / `tpm:MINUTE` (a fixed minute), `tpd:DAY`, `tpw:WEEK`, `tpmo:MONTH`, `spd:DAY`,
`budget:PERIOD:N` (calendar windows in the quota's zone) and `parallel` (held slots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ctxgate.gateway.quota.calendar import calendar_window
from ctxgate.gateway.quota.model import (
    COUNTER,
    DEFAULT_SLOT_TTL_S,
    NO_LIMIT,
    SLIDING,
    SLOT_CHECK,
    SLOT_HOLD,
    Meter,
    QuotaExceeded,
    QuotaLimits,
)
from ctxgate.gateway.quota.sliding import WINDOW_S, bucket_of

MINUTE_S = 60
DAY_S = 86400
_MINUTE_KEYS = {"requests_per_minute": "rpm", "tokens_per_minute": "tpm"}
# (limit, key, calendar period, unit) of the limits counted in calendar windows.
_CALENDAR = (
    ("tokens_per_day", "tpd", "day", "tokens"),
    ("tokens_per_week", "tpw", "week", "tokens"),
    ("tokens_per_month", "tpmo", "month", "tokens"),
    ("spend_per_day", "spd", "day", "spend"),
)


@dataclass(frozen=True)
class Scope:
    """Whose limits a meter counts: the ledger prefix, the name messages use, tenant or key, model."""

    prefix: str
    label: str
    owner: str
    model: str | None = None

    def for_model(self, model: str) -> Scope:
        return Scope(f"{self.prefix}:model:{model}", f"{self.label} for model '{model}'", self.owner, model)


def tenant_prefix(tenant: str) -> str:
    # The {tenant} hash tag keeps a tenant's keys (its API keys' too) in one Redis Cluster slot,
    # which a Lua script touching both needs.
    return f"ctxgate:quota:{{{tenant}}}"


def _meter(scope: Scope, limits: QuotaLimits, **fields) -> Meter:
    return Meter(
        owner=scope.owner, model=scope.model, time_zone=limits.time_zone, scope=scope.label, **fields
    )


def _minute_meter(
    scope: Scope, limits: QuotaLimits, reason: str, limit: int, amount: int, now: float
) -> Meter:
    unit = "requests" if reason == "requests_per_minute" else "tokens"
    short = _MINUTE_KEYS[reason]
    if limits.window == "fixed":
        minute = int(now // MINUTE_S)
        return _meter(
            scope,
            limits,
            key=f"{scope.prefix}:{short}:{minute}",
            limit=limit,
            amount=amount,
            ttl_s=MINUTE_S * 2,
            reason=reason,
            unit=unit,
            retry_after_s=math.ceil(MINUTE_S - now % MINUTE_S),
            ends_at=float((minute + 1) * MINUTE_S),
        )
    return _meter(
        scope,
        limits,
        key=f"{scope.prefix}:{short}",
        limit=limit,
        amount=amount,
        ttl_s=WINDOW_S * 2,
        reason=reason,
        unit=unit,
        retry_after_s=WINDOW_S,
        kind=SLIDING,
        bucket=bucket_of(now),
    )


def _calendar_meter(
    scope: Scope, limits: QuotaLimits, reason: str, key: str, period: str, limit: int, amount: int, now: float
) -> Meter:
    window = calendar_window(period, now, limits.time_zone)
    return _meter(
        scope,
        limits,
        key=f"{scope.prefix}:{key}:{window.number}",
        limit=limit,
        amount=amount,
        ttl_s=math.ceil(window.end - now) + DAY_S,
        reason=reason,
        unit="spend" if reason in ("spend_per_day", "budget") else "tokens",
        retry_after_s=window.seconds_left(now),
        period=period,
        ends_at=window.end,
    )


def _scope_meters(
    scope: Scope, limits: QuotaLimits, tokens: int, spend_micros: int, now: float, slot: int
) -> list[Meter]:
    """The meters of one scope's own limits (never its limits per model)."""
    amounts = {"requests": 1, "tokens": tokens, "spend": spend_micros}
    meters = [
        _minute_meter(
            scope, limits, reason, int(limit), amounts["requests" if short == "rpm" else "tokens"], now
        )
        for reason, short in _MINUTE_KEYS.items()
        if (limit := getattr(limits, reason)) is not None
    ]
    for reason, key, period, unit in _CALENDAR:
        limit = limits.spend_limit_micros() if unit == "spend" else getattr(limits, reason)
        if limit is not None:
            meters.append(_calendar_meter(scope, limits, reason, key, period, int(limit), amounts[unit], now))
    budget = limits.budget_micros()
    if budget is not None:
        period = limits.budget_period
        meters.append(
            _calendar_meter(scope, limits, "budget", f"budget:{period}", period, budget, spend_micros, now)
        )
    if limits.max_parallel_requests is not None:
        meters.append(
            _meter(
                scope,
                limits,
                key=f"{scope.prefix}:parallel",
                limit=limits.max_parallel_requests,
                amount=1,
                ttl_s=DEFAULT_SLOT_TTL_S,
                reason="max_parallel_requests",
                unit="slots",
                retry_after_s=1,
                kind=slot,
                period="slots",
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
    model: str | None = None,
) -> list[Meter]:
    """Every meter one request touches: the tenant's, its limits for `model`, then its API key's and
    the key's for `model` (a key's only when the key has limits)."""
    slot = SLOT_HOLD if hold_slot else SLOT_CHECK
    tenant_scope = Scope(tenant_prefix(tenant), f"tenant '{tenant}'", "tenant")
    scopes = [(tenant_scope, limits)]
    if key_id is not None and key_limits is not None:
        scopes.append(
            (Scope(f"{tenant_scope.prefix}:key:{key_id}", f"API key '{key_id}'", "key"), key_limits)
        )
    meters: list[Meter] = []
    for scope, scope_limits in scopes:
        meters += _scope_meters(scope, scope_limits, tokens, spend_micros, now, slot)
        if model is not None and model in scope_limits.models:
            meters += _scope_meters(
                scope.for_model(model), scope_limits.models[model], tokens, spend_micros, now, slot
            )
    return meters


def _check_fits_at_all(meters: list[Meter]) -> None:
    """A request larger than a whole window's allowance can never pass: say so instead of waiting."""
    for meter in meters:
        if meter.unit in ("tokens", "spend") and meter.limit != NO_LIMIT and meter.amount > meter.limit:
            unit = " micro-units" if meter.unit == "spend" else " tokens"
            owner = "the tenant's" if meter.owner == "tenant" else "the API key's"
            model = f" for model '{meter.model}'" if meter.model is not None else ""
            raise QuotaExceeded(
                meter.reason,
                meter.retry_after_s,
                f"this request alone needs more than {owner} {meter.reason} quota{model} ({meter.amount} > "
                f"{meter.limit}{unit}); lower max_tokens or the prompt",
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
    model: str | None = None,
) -> list[Meter]:
    """The meters a store checks and applies for one request at `now`; raises QuotaExceeded at once
    for a request that could not fit in an empty window. `slot_id`: hold a parallel slot under it."""
    meters = build_meters(
        tenant, limits, tokens, spend_micros, now, key_id, key_limits, slot_id is not None, model
    )
    _check_fits_at_all(meters)
    return meters


def counter_meters(meters: list[Meter]) -> list[Meter]:
    """The meters that count amounts (not parallel slots)."""
    return [meter for meter in meters if meter.kind in (COUNTER, SLIDING)]
