"""The Redis ledger, shared by every gateway replica pointing at the same Redis.

Each reservation and each reconcile is one Lua script, so it is atomic against every replica's.
The time comes from the calling gateway's clock (passed as an argument), never from Redis: it
picks the window keys and the parallel-slot deadlines. Redis's own TTLs only collect windows that
have ended. A counter is created with a TTL and a late reconcile never recreates an expired one.
Any Redis or socket error surfaces as `StoreUnavailable`; the client reconnects by itself on the
next command, which is how a gateway recovers without a restart.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ctxgate.gateway.quota.model import (
    SLOT_HOLD,
    USAGE_NAMES,
    QuotaLimits,
    Reservation,
    StoreUnavailable,
    exceeded,
    plan_reservation,
    reconcile_deltas,
    usage_keys,
)
from ctxgate.gateway.quota.rate_limits import rate_limit_state
from ctxgate.gateway.quota.room import room_left, token_meters
from ctxgate.gateway.quota.store import Clock

T = TypeVar("T")

# Check every meter first, then apply every one: all-or-nothing in one atomic script.
# ARGV: now, slot id, then per key: kind, limit, amount, ttl. Returns {admitted (1/0), index of the
# refusing meter (0 when admitted), then each meter's level}: its counter or the live slots held,
# after the reservation when admitted, as read when refused. The levels come from the same atomic
# script, so the rate-limit headers built from them are exact.
RESERVE_LUA = """
local now = tonumber(ARGV[1])
local result = {1, 0}
for i = 1, #KEYS do
  local base = 2 + (i - 1) * 4
  if tonumber(ARGV[base + 1]) == 0 then
    result[i + 2] = tonumber(redis.call('GET', KEYS[i]) or '0')
  else
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    result[i + 2] = redis.call('ZCARD', KEYS[i])
  end
end
for i = 1, #KEYS do
  local base = 2 + (i - 1) * 4
  local kind, limit, amount = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local over
  if kind == 0 then over = limit >= 0 and result[i + 2] + amount > limit else over = result[i + 2] + 1 > limit end
  if over then
    result[1], result[2] = 0, i
    return result
  end
end
for i = 1, #KEYS do
  local base = 2 + (i - 1) * 4
  local kind, amount, ttl = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4])
  if kind == 0 then
    result[i + 2] = redis.call('INCRBY', KEYS[i], amount)
    if redis.call('TTL', KEYS[i]) < 0 then redis.call('EXPIRE', KEYS[i], ttl) end
  elseif kind == 2 then
    redis.call('ZADD', KEYS[i], now + ttl, ARGV[2])
    redis.call('EXPIRE', KEYS[i], ttl)
    result[i + 2] = redis.call('ZCARD', KEYS[i])
  end
end
return result
"""

# `reserve`'s checks alone, read-only (a slot set's live members are those whose deadline is after
# now); the same reply, with the levels as read.
CHECK_LUA = """
local now = tonumber(ARGV[1])
local result = {1, 0}
for i = 1, #KEYS do
  local base = 2 + (i - 1) * 4
  if tonumber(ARGV[base + 1]) == 0 then
    result[i + 2] = tonumber(redis.call('GET', KEYS[i]) or '0')
  else
    result[i + 2] = redis.call('ZCOUNT', KEYS[i], '(' .. ARGV[1], '+inf')
  end
end
for i = 1, #KEYS do
  local base = 2 + (i - 1) * 4
  local kind, limit, amount = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local over
  if kind == 0 then over = limit >= 0 and result[i + 2] + amount > limit else over = result[i + 2] + 1 > limit end
  if over and result[1] == 1 then result[1], result[2] = 0, i end
end
return result
"""

# Counters: add the delta only to keys that still exist (an expired window must not be resurrected
# by a late delta). Slot sets: remove this request's slot. ARGV: slot id, then one delta per key
# ('slot' for a slot set).
RECONCILE_LUA = """
for i = 1, #KEYS do
  local arg = ARGV[i + 1]
  if arg == 'slot' then
    redis.call('ZREM', KEYS[i], ARGV[1])
  else
    local delta = tonumber(arg)
    if delta ~= 0 and redis.call('EXISTS', KEYS[i]) == 1 then
      local value = redis.call('INCRBY', KEYS[i], delta)
      if value < 0 then redis.call('SET', KEYS[i], 0, 'KEEPTTL') end
    end
  end
end
return 1
"""


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
        self._reserve = self._client.register_script(RESERVE_LUA)
        self._reconcile = self._client.register_script(RECONCILE_LUA)
        self._check = self._client.register_script(CHECK_LUA)

    async def _call(self, coro_factory: Callable[[], Awaitable[T]]) -> T:
        from redis.exceptions import RedisError

        try:
            return await coro_factory()
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(
                f"quota store (redis) unavailable: {exc.__class__.__name__}: {exc}"
            ) from exc

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
        keys = [meter.key for meter in meters]
        args: list[Any] = [repr(now), slot_id or ""]
        for meter in meters:
            args += [meter.kind, meter.limit, meter.amount, meter.ttl_s]
        admitted, index, *raw_levels = await self._call(lambda: self._reserve(keys=keys, args=args))
        levels = [int(level) for level in raw_levels]
        state = rate_limit_state(meters, levels)
        if int(admitted) != 1:
            raise exceeded(meters[int(index) - 1], levels[int(index) - 1], state)
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
        meters = plan_reservation(tenant, limits, tokens, spend_micros, now, key_id, key_limits, None)
        if not meters:
            return
        args: list[Any] = [repr(now), ""]
        for meter in meters:
            args += [meter.kind, meter.limit, meter.amount, meter.ttl_s]
        fits, index, *raw_levels = await self._call(
            lambda: self._check(keys=[meter.key for meter in meters], args=args)
        )
        if int(fits) != 1:
            levels = [int(level) for level in raw_levels]
            raise exceeded(meters[int(index) - 1], levels[int(index) - 1], rate_limit_state(meters, levels))

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
        if not meters:
            return None
        values = await self._call(lambda: self._client.mget([meter.key for meter in meters]))
        return room_left(meters, [int(value or 0) for value in values])

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
        if not meters:
            return None
        values = await self._call(lambda: self._client.mget([meter.key for meter in meters]))
        return room_left(meters, [int(value or 0) for value in values])

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_spend_micros: int) -> None:
        deltas = [
            (meter, delta)
            for meter, delta in reconcile_deltas(reservation, actual_tokens, actual_spend_micros)
            if delta or meter.kind == SLOT_HOLD
        ]
        if not deltas:
            return
        keys = [meter.key for meter, _ in deltas]
        args = [reservation.slot_id or ""] + [
            "slot" if meter.kind == SLOT_HOLD else delta for meter, delta in deltas
        ]
        await self._call(lambda: self._reconcile(keys=keys, args=args))

    async def usage(self, tenant: str, now: float | None = None) -> dict[str, int]:
        now = self.clock() if now is None else now
        values = await self._call(lambda: self._client.mget(usage_keys(tenant, now)))
        return {name: int(value or 0) for name, value in zip(USAGE_NAMES, values, strict=True)}

    async def ping(self) -> bool:
        try:
            return bool(await self._call(self._client.ping))
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        await self._client.aclose()
