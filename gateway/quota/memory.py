"""The in-process ledger: one gateway process's counters and parallel slots, in dictionaries.

Enough for a single gateway; replicas must share the Redis store. Atomicity comes from the event
loop: `reserve` has no await between checking and applying. A counter expires `ttl_s` after the
first amount in its window (by the store's clock); a held slot expires at its deadline, so a
request that was never settled cannot hold it forever.
"""

from __future__ import annotations

import math
import time

from ctxgate.gateway.quota.model import (
    COUNTER,
    NO_LIMIT,
    SLOT_HOLD,
    USAGE_NAMES,
    Meter,
    QuotaLimits,
    Reservation,
    exceeded,
    plan_reservation,
    reconcile_deltas,
    usage_keys,
)
from ctxgate.gateway.quota.rate_limits import rate_limit_state
from ctxgate.gateway.quota.room import room_left, token_meters
from ctxgate.gateway.quota.store import Clock


class InProcessQuotaStore:
    """One process's ledger. Enough for a single gateway; replicas need the Redis store."""

    name = "memory"

    def __init__(self, clock: Clock = time.time) -> None:
        self.clock = clock
        self._counters: dict[str, int] = {}
        self._expiry: dict[str, float] = {}
        self._slots: dict[str, dict[str, float]] = {}  # parallel-slot sets: request id -> deadline

    def _get(self, key: str, now: float) -> int:
        if self._expiry.get(key, math.inf) <= now:
            self._counters.pop(key, None)
            self._expiry.pop(key, None)
        return self._counters.get(key, 0)

    def _add(self, key: str, amount: int, ttl: float, now: float) -> None:
        self._counters[key] = self._get(key, now) + amount
        self._expiry.setdefault(key, now + ttl)

    def _live_slots(self, key: str, now: float) -> dict[str, float]:
        slots = self._slots.setdefault(key, {})
        for slot, deadline in list(slots.items()):
            if deadline <= now:
                del slots[slot]
        return slots

    def _evict_expired(self, now: float) -> None:
        for key in [k for k, expiry in self._expiry.items() if expiry <= now]:
            self._counters.pop(key, None)
            self._expiry.pop(key, None)

    async def reserve(
        self,
        tenant: str,
        limits: QuotaLimits,
        tokens: int,
        spend_micros: int,
        now: float | None = None,
        *,
        key_id: str | None = None,
        key_limits: QuotaLimits | None = None,
        slot_id: str | None = None,
    ) -> Reservation:
        now = self.clock() if now is None else now
        meters = plan_reservation(tenant, limits, tokens, spend_micros, now, key_id, key_limits, slot_id)
        self._evict_expired(now)
        # No await between check and apply: atomic on the event loop.
        self._refuse_if_over(meters, now)
        for meter in meters:
            if meter.kind == COUNTER:
                self._add(meter.key, meter.amount, meter.ttl_s, now)
            elif meter.kind == SLOT_HOLD:
                self._live_slots(meter.key, now)[str(slot_id)] = now + meter.ttl_s
        state = rate_limit_state(meters, self._levels(meters, now))
        return Reservation(tenant, tokens, spend_micros, tuple(meters), slot_id=slot_id, rate_limits=state)

    async def check(
        self,
        tenant: str,
        limits: QuotaLimits,
        tokens: int,
        spend_micros: int,
        now: float | None = None,
        *,
        key_id: str | None = None,
        key_limits: QuotaLimits | None = None,
    ) -> None:
        now = self.clock() if now is None else now
        self._refuse_if_over(
            plan_reservation(tenant, limits, tokens, spend_micros, now, key_id, key_limits, None), now
        )

    def _levels(self, meters: list[Meter], now: float) -> list[int]:
        """Each meter's counter, or the number of slots held."""
        return [
            self._get(m.key, now) if m.kind == COUNTER else len(self._live_slots(m.key, now)) for m in meters
        ]

    def _refuse_if_over(self, meters: list[Meter], now: float) -> None:
        levels = self._levels(meters, now)
        for meter, level in zip(meters, levels, strict=True):
            if meter.kind == COUNTER:
                over = meter.limit != NO_LIMIT and level + meter.amount > meter.limit
            else:
                over = level + 1 > meter.limit
            if over:
                raise exceeded(meter, level, rate_limit_state(meters, levels))

    async def tokens_left(
        self,
        tenant: str,
        limits: QuotaLimits,
        now: float | None = None,
        *,
        key_id: str | None = None,
        key_limits: QuotaLimits | None = None,
    ) -> int | None:
        now = self.clock() if now is None else now
        meters = token_meters(tenant, limits, now, key_id, key_limits)
        return room_left(meters, [self._get(meter.key, now) for meter in meters])

    async def spend_left(
        self,
        tenant: str,
        limits: QuotaLimits,
        now: float | None = None,
        *,
        key_id: str | None = None,
        key_limits: QuotaLimits | None = None,
    ) -> int | None:
        now = self.clock() if now is None else now
        meters = token_meters(tenant, limits, now, key_id, key_limits, unit="spend")
        return room_left(meters, [self._get(meter.key, now) for meter in meters])

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_spend_micros: int) -> None:
        for meter, delta in reconcile_deltas(reservation, actual_tokens, actual_spend_micros):
            if meter.kind == SLOT_HOLD:
                self._slots.get(meter.key, {}).pop(str(reservation.slot_id), None)
            elif delta and meter.key in self._counters:  # a window already evicted stays gone
                self._counters[meter.key] = max(0, self._counters[meter.key] + delta)

    async def usage(self, tenant: str, now: float | None = None) -> dict[str, int]:
        now = self.clock() if now is None else now
        return {
            name: self._get(key, now) for name, key in zip(USAGE_NAMES, usage_keys(tenant, now), strict=True)
        }

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
