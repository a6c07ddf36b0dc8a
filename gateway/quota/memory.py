"""The in-process ledger: one gateway process's counters, sliding windows and parallel slots.

Enough for a single gateway; replicas must share the Redis store. Atomicity comes from the event
loop: `reserve` has no await between checking and applying. A counter expires `ttl_s` after the
first amount in its window (by the store's clock); a sliding window keeps at most its 61 live
buckets (`ctxgate.gateway.quota.sliding`); a held slot expires at its deadline, so a request that
was never settled cannot hold it forever.
"""

from __future__ import annotations

import math
import time

from ctxgate.gateway.quota.meters import build_meters, plan_reservation
from ctxgate.gateway.quota.model import (
    COUNTER,
    SLIDING,
    SLOT_HOLD,
    LimitUsage,
    Meter,
    QuotaLimits,
    Reading,
    Reservation,
    has_room,
    reconcile_deltas,
    usage_of,
)
from ctxgate.gateway.quota.rate_limits import rate_limit_state
from ctxgate.gateway.quota.refusal import exceeded
from ctxgate.gateway.quota.room import room_left, token_meters
from ctxgate.gateway.quota.sliding import level, oldest_counted, seconds_to_empty, wait_for_room
from ctxgate.gateway.quota.store import Clock


class InProcessQuotaStore:
    """One process's ledger. Enough for a single gateway; replicas need the Redis store."""

    name = "memory"

    def __init__(self, clock: Clock = time.time) -> None:
        self.clock = clock
        self._counters: dict[str, int] = {}
        self._expiry: dict[str, float] = {}
        self._buckets: dict[str, dict[int, int]] = {}  # sliding windows: bucket (second) -> amount
        self._slots: dict[str, dict[str, float]] = {}  # parallel-slot sets: request id -> deadline

    def _get(self, key: str, now: float) -> int:
        if self._expiry.get(key, math.inf) <= now:
            self._counters.pop(key, None)
            self._expiry.pop(key, None)
        return self._counters.get(key, 0)

    def _add(self, key: str, amount: int, ttl: float, now: float) -> None:
        self._counters[key] = self._get(key, now) + amount
        self._expiry.setdefault(key, now + ttl)

    def _live_buckets(self, key: str, now: float) -> dict[int, int]:
        buckets = self._buckets.get(key, {})
        oldest = oldest_counted(now)
        for bucket in [b for b in buckets if b < oldest]:
            del buckets[bucket]
        return buckets

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
        for key in [k for k in self._buckets if not self._live_buckets(k, now)]:
            del self._buckets[key]

    def _read(self, meter: Meter, now: float) -> Reading:
        if meter.kind == COUNTER:
            return Reading(self._get(meter.key, now), meter.retry_after_s)
        if meter.kind == SLIDING:
            buckets = self._live_buckets(meter.key, now)
            return Reading(level(buckets, now), seconds_to_empty(buckets, now))
        return Reading(len(self._live_slots(meter.key, now)), meter.retry_after_s)

    def _refuse_if_over(self, meters: list[Meter], now: float) -> None:
        readings = [self._read(meter, now) for meter in meters]
        for meter, reading in zip(meters, readings, strict=True):
            if not has_room(meter, reading.level):
                wait = meter.retry_after_s
                if meter.kind == SLIDING:
                    wait = wait_for_room(self._live_buckets(meter.key, now), now, meter.amount, meter.limit)
                raise exceeded(meter, reading, wait, now, rate_limit_state(meters, readings))

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
        model: str | None = None,
    ) -> Reservation:
        now = self.clock() if now is None else now
        meters = plan_reservation(
            tenant, limits, tokens, spend_micros, now, key_id, key_limits, slot_id, model
        )
        self._evict_expired(now)
        # No await between check and apply: atomic on the event loop.
        self._refuse_if_over(meters, now)
        for meter in meters:
            if meter.kind == COUNTER:
                self._add(meter.key, meter.amount, meter.ttl_s, now)
            elif meter.kind == SLIDING:
                buckets = self._buckets.setdefault(meter.key, {})
                buckets[meter.bucket] = buckets.get(meter.bucket, 0) + meter.amount
            elif meter.kind == SLOT_HOLD:
                self._live_slots(meter.key, now)[str(slot_id)] = now + meter.ttl_s
        readings = [self._read(meter, now) for meter in meters]
        return Reservation(
            tenant,
            tokens,
            spend_micros,
            tuple(meters),
            slot_id=slot_id,
            rate_limits=rate_limit_state(meters, readings),
            usage=usage_of(meters, readings, now),
        )

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
        model: str | None = None,
    ) -> None:
        now = self.clock() if now is None else now
        self._refuse_if_over(
            plan_reservation(tenant, limits, tokens, spend_micros, now, key_id, key_limits, None, model),
            now,
        )

    async def tokens_left(
        self,
        tenant: str,
        limits: QuotaLimits,
        now: float | None = None,
        *,
        key_id: str | None = None,
        key_limits: QuotaLimits | None = None,
        model: str | None = None,
    ) -> int | None:
        return await self._left("tokens", tenant, limits, now, key_id, key_limits, model)

    async def spend_left(
        self,
        tenant: str,
        limits: QuotaLimits,
        now: float | None = None,
        *,
        key_id: str | None = None,
        key_limits: QuotaLimits | None = None,
        model: str | None = None,
    ) -> int | None:
        return await self._left("spend", tenant, limits, now, key_id, key_limits, model)

    async def _left(
        self,
        unit: str,
        tenant: str,
        limits: QuotaLimits,
        now: float | None,
        key_id: str | None,
        key_limits: QuotaLimits | None,
        model: str | None,
    ) -> int | None:
        """What every limited meter of `unit` (tokens or spend) has left now: a read only."""
        now = self.clock() if now is None else now
        meters = token_meters(tenant, limits, now, key_id, key_limits, model, unit=unit)
        return room_left(meters, [self._read(meter, now).level for meter in meters])

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_spend_micros: int) -> None:
        for meter, delta in reconcile_deltas(reservation, actual_tokens, actual_spend_micros):
            if meter.kind == SLOT_HOLD:
                self._slots.get(meter.key, {}).pop(str(reservation.slot_id), None)
            elif meter.kind == SLIDING:
                buckets = self._buckets.get(meter.key, {})
                if delta and meter.bucket in buckets:  # a bucket already gone from the window stays gone
                    buckets[meter.bucket] = max(0, buckets[meter.bucket] + delta)
            elif delta and meter.key in self._counters:  # a window already evicted stays gone
                self._counters[meter.key] = max(0, self._counters[meter.key] + delta)

    async def usage(
        self,
        tenant: str,
        limits: QuotaLimits,
        now: float | None = None,
        *,
        key_id: str | None = None,
        key_limits: QuotaLimits | None = None,
        model: str | None = None,
    ) -> tuple[LimitUsage, ...]:
        now = self.clock() if now is None else now
        meters = build_meters(tenant, limits, 0, 0, now, key_id, key_limits, model=model)
        return usage_of(meters, [self._read(meter, now) for meter in meters], now)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
