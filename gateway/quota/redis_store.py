"""The Redis ledger, shared by every gateway replica pointing at the same Redis.

Each reservation and each reconcile is one Lua script (`ctxgate.gateway.quota.redis_lua`), so it is
atomic against every replica's. The time comes from the calling gateway's clock (passed as an
argument), never from Redis: it picks the window keys, the sliding window's buckets and the
parallel-slot deadlines. Redis's own TTLs only collect windows that have ended. A counter is created
with a TTL and a late reconcile never recreates an expired one. Any Redis or socket error surfaces
as `StoreUnavailable`; the client reconnects by itself on the next command, which is how a gateway
recovers without a restart.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ctxgate.gateway.quota import redis_lua
from ctxgate.gateway.quota.meters import build_meters, plan_reservation
from ctxgate.gateway.quota.model import (
    SLIDING,
    SLOT_HOLD,
    LimitUsage,
    Meter,
    QuotaLimits,
    Reading,
    Reservation,
    StoreUnavailable,
    reconcile_deltas,
    usage_of,
)
from ctxgate.gateway.quota.rate_limits import rate_limit_state
from ctxgate.gateway.quota.refusal import exceeded
from ctxgate.gateway.quota.room import room_left, token_meters
from ctxgate.gateway.quota.sliding import oldest_counted, seconds_to_empty, wait_for_room
from ctxgate.gateway.quota.store import Clock

T = TypeVar("T")


class _Reply:
    """A RESERVE or CHECK reply, read: whether it fitted, which meter refused, each meter's reading."""

    def __init__(self, meters: list[Meter], raw: list[Any], now: float):
        n = len(meters)
        self.fits = int(raw[0]) == 1
        self.index = int(raw[1]) - 1
        levels = [int(value) for value in raw[2 : 2 + n]]
        newest = [int(value) for value in raw[2 + n : 2 + 2 * n]]
        self.readings = [
            Reading(level, seconds_to_empty({top: 1} if top >= 0 else {}, now))
            if meter.kind == SLIDING
            else Reading(level, meter.retry_after_s)
            for meter, level, top in zip(meters, levels, newest, strict=True)
        ]
        pairs = raw[2 + 2 * n :]
        self.refused_buckets = {int(pairs[i]): int(pairs[i + 1]) for i in range(0, len(pairs), 2)}

    def raise_if_refused(self, meters: list[Meter], now: float) -> None:
        if self.fits:
            return
        meter, reading = meters[self.index], self.readings[self.index]
        wait = meter.retry_after_s
        if meter.kind == SLIDING:
            wait = wait_for_room(self.refused_buckets, now, meter.amount, meter.limit)
        raise exceeded(meter, reading, wait, now, rate_limit_state(meters, self.readings))


def _args(meters: list[Meter], now: float, slot_id: str | None) -> list[Any]:
    args: list[Any] = [repr(now), slot_id or "", oldest_counted(now)]
    for meter in meters:
        args += [meter.kind, meter.limit, meter.amount, meter.ttl_s, meter.bucket]
    return args


class RedisQuotaStore:
    """A ledger shared by every gateway replica pointing at the same Redis."""

    name = "redis"

    def __init__(self, url: str, timeout_s: float = 0.5, clock: Clock = time.time):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url = url
        self.clock = clock
        # Fail fast when Redis is down (the policy decides allow/deny); the client reconnects on its
        # own on the next command, which is how the gateway recovers without a restart.
        self._client = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
            decode_responses=True,
        )
        self._reserve = self._client.register_script(redis_lua.RESERVE)
        self._reconcile = self._client.register_script(redis_lua.RECONCILE)
        self._check = self._client.register_script(redis_lua.CHECK)

    async def _call(self, coro_factory: Callable[[], Awaitable[T]]) -> T:
        from redis.exceptions import RedisError

        try:
            return await coro_factory()
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(
                f"quota store (redis) unavailable: {exc.__class__.__name__}: {exc}"
            ) from exc

    async def _read(self, meters: list[Meter], now: float) -> _Reply:
        """The CHECK script's reply for `meters` (read-only)."""
        keys = [meter.key for meter in meters]
        raw = await self._call(lambda: self._check(keys=keys, args=_args(meters, now, None)))
        return _Reply(meters, raw, now)

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
        keys = [meter.key for meter in meters]
        raw = await self._call(lambda: self._reserve(keys=keys, args=_args(meters, now, slot_id)))
        reply = _Reply(meters, raw, now)
        reply.raise_if_refused(meters, now)
        return Reservation(
            tenant,
            tokens,
            spend_micros,
            tuple(meters),
            slot_id=slot_id,
            rate_limits=rate_limit_state(meters, reply.readings),
            usage=usage_of(meters, reply.readings, now),
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
        meters = plan_reservation(tenant, limits, tokens, spend_micros, now, key_id, key_limits, None, model)
        if meters:
            (await self._read(meters, now)).raise_if_refused(meters, now)

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
        if not meters:
            return None
        reply = await self._read(meters, now)
        return room_left(meters, [reading.level for reading in reply.readings])

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_spend_micros: int) -> None:
        deltas = [
            (meter, delta)
            for meter, delta in reconcile_deltas(reservation, actual_tokens, actual_spend_micros)
            if delta or meter.kind == SLOT_HOLD
        ]
        if not deltas:
            return
        keys = [meter.key for meter, _ in deltas]
        args: list[Any] = [reservation.slot_id or ""]
        for meter, delta in deltas:
            args += [meter.kind, meter.bucket, delta]
        await self._call(lambda: self._reconcile(keys=keys, args=args))

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
        if not meters:
            return ()
        return usage_of(meters, (await self._read(meters, now)).readings, now)

    async def ping(self) -> bool:
        try:
            return bool(await self._call(self._client.ping))
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        await self._client.aclose()
