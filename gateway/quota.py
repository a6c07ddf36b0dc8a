"""Per-tenant quotas: reserve before the model call, reconcile with the real count afterwards.

Windows are fixed and aligned to the clock (minute, UTC day), so every replica computes the same
window keys. A reservation is admitted only if it fits under every limit, checked and applied in
one atomic step (a Lua script in Redis), so replicas sharing a store never exceed a limit by more
than the amount a reconcile can add after the fact (at most one request's reservation).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from policies.schema import QuotaPolicy

logger = logging.getLogger(__name__)

MINUTE_S = 60
DAY_S = 86400
SPEND_SCALE = 1_000_000  # spend is stored in micro-units of the currency: integer arithmetic only
NO_LIMIT = -1


@dataclass(frozen=True)
class QuotaLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    spend_per_day: float | None = None
    on_store_error: str = "allow"

    @classmethod
    def from_policy(cls, quota: QuotaPolicy, override: dict[str, Any] | None = None) -> QuotaLimits:
        values = quota.model_dump()
        values.update(override or {})
        return cls(**{name: values.get(name) for name in cls.__dataclass_fields__ if name in values})

    @property
    def unlimited(self) -> bool:
        return all(
            limit is None
            for limit in (self.requests_per_minute, self.tokens_per_minute, self.tokens_per_day, self.spend_per_day)
        )

    def spend_limit_micros(self) -> int | None:
        return None if self.spend_per_day is None else int(round(self.spend_per_day * SPEND_SCALE))


class QuotaExceeded(Exception):
    def __init__(self, reason: str, retry_after_s: int, message: str):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = max(1, retry_after_s)


class StoreUnavailable(Exception):
    """The quota store cannot be reached; the policy's `on_store_error` decides what happens."""


@dataclass
class Windows:
    minute: int
    day: int
    seconds_to_minute_end: int
    seconds_to_day_end: int

    @classmethod
    def at(cls, now: float) -> Windows:
        return cls(
            minute=int(now // MINUTE_S),
            day=int(now // DAY_S),
            seconds_to_minute_end=math.ceil(MINUTE_S - now % MINUTE_S),
            seconds_to_day_end=math.ceil(DAY_S - now % DAY_S),
        )


@dataclass
class Reservation:
    tenant: str
    tokens: int
    spend_micros: int
    windows: Windows | None
    # False when the store was down and the request was let through (on_store_error: allow):
    # there is nothing to reconcile then.
    recorded: bool = True
    reconciled: bool = field(default=False)


def _keys(tenant: str, windows: Windows) -> list[str]:
    # The {tenant} hash tag keeps one tenant's keys in one Redis Cluster slot (a Lua requirement).
    base = f"ctxgate:quota:{{{tenant}}}"
    return [
        f"{base}:rpm:{windows.minute}",
        f"{base}:tpm:{windows.minute}",
        f"{base}:tpd:{windows.day}",
        f"{base}:spd:{windows.day}",
    ]


def _retry_after(reason: str, windows: Windows) -> int:
    return windows.seconds_to_minute_end if reason.endswith("per_minute") else windows.seconds_to_day_end


def _check_fits_at_all(limits: QuotaLimits, tokens: int, spend_micros: int, windows: Windows) -> None:
    """A request larger than a whole window's allowance can never pass: say so instead of waiting."""
    for reason, limit, amount in (
        ("tokens_per_minute", limits.tokens_per_minute, tokens),
        ("tokens_per_day", limits.tokens_per_day, tokens),
        ("spend_per_day", limits.spend_limit_micros(), spend_micros),
    ):
        if limit is not None and amount > limit:
            raise QuotaExceeded(
                reason,
                _retry_after(reason, windows),
                f"this request alone needs more than the tenant's {reason} quota ({amount} > {limit}"
                f"{' micro-units' if reason == 'spend_per_day' else ' tokens'}); lower max_tokens or the prompt",
            )


def _exceeded(reason: str, tenant: str, windows: Windows) -> QuotaExceeded:
    return QuotaExceeded(reason, _retry_after(reason, windows), f"tenant '{tenant}' is over its {reason} quota")


class QuotaStore(Protocol):
    name: str

    async def reserve(
        self, tenant: str, limits: QuotaLimits, tokens: int, spend_micros: int, now: float | None = None
    ) -> Reservation: ...

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_spend_micros: int) -> None: ...

    async def usage(self, tenant: str, now: float | None = None) -> dict[str, int]: ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


def _limit_args(limits: QuotaLimits) -> list[int]:
    values = [limits.requests_per_minute, limits.tokens_per_minute, limits.tokens_per_day, limits.spend_limit_micros()]
    return [NO_LIMIT if value is None else int(value) for value in values]


class InProcessQuotaStore:
    """One process's ledger. Enough for a single gateway; replicas need the Redis store."""

    name = "memory"

    def __init__(self) -> None:
        self._counters: dict[str, int] = {}
        self._expiry: dict[str, float] = {}

    def _get(self, key: str, now: float) -> int:
        if self._expiry.get(key, math.inf) <= now:
            self._counters.pop(key, None)
            self._expiry.pop(key, None)
        return self._counters.get(key, 0)

    def _add(self, key: str, amount: int, ttl: float, now: float) -> None:
        self._counters[key] = self._get(key, now) + amount
        self._expiry.setdefault(key, now + ttl)

    def _evict_expired(self, now: float) -> None:
        for key in [k for k, expiry in self._expiry.items() if expiry <= now]:
            self._counters.pop(key, None)
            self._expiry.pop(key, None)

    async def reserve(
        self, tenant: str, limits: QuotaLimits, tokens: int, spend_micros: int, now: float | None = None
    ) -> Reservation:
        now = time.time() if now is None else now
        windows = Windows.at(now)
        _check_fits_at_all(limits, tokens, spend_micros, windows)
        self._evict_expired(now)
        keys = _keys(tenant, windows)
        amounts = [1, tokens, tokens, spend_micros]
        reasons = ["requests_per_minute", "tokens_per_minute", "tokens_per_day", "spend_per_day"]
        # No await between check and apply: atomic on the event loop.
        for key, limit, amount, reason in zip(keys, _limit_args(limits), amounts, reasons, strict=True):
            if limit != NO_LIMIT and self._get(key, now) + amount > limit:
                raise _exceeded(reason, tenant, windows)
        for index, (key, amount) in enumerate(zip(keys, amounts, strict=True)):
            self._add(key, amount, MINUTE_S * 2 if index < 2 else DAY_S * 2, now)
        return Reservation(tenant, tokens, spend_micros, windows)

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_spend_micros: int) -> None:
        deltas = _reconcile_deltas(reservation, actual_tokens, actual_spend_micros)
        if deltas is None:
            return
        for key, delta in deltas:
            if delta and key in self._counters:  # a window already evicted stays gone
                self._counters[key] = max(0, self._counters[key] + delta)

    async def usage(self, tenant: str, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        keys = _keys(tenant, Windows.at(now))
        names = ["requests_this_minute", "tokens_this_minute", "tokens_today", "spend_micros_today"]
        return {name: self._get(key, now) for name, key in zip(names, keys, strict=True)}

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None


# Check every limit first, then apply every increment: all-or-nothing in one atomic script.
_RESERVE_LUA = """
local amounts = {1, tonumber(ARGV[5]), tonumber(ARGV[5]), tonumber(ARGV[6])}
local reasons = {'requests_per_minute', 'tokens_per_minute', 'tokens_per_day', 'spend_per_day'}
for i = 1, 4 do
  local limit = tonumber(ARGV[i])
  if limit >= 0 then
    local current = tonumber(redis.call('GET', KEYS[i]) or '0')
    if current + amounts[i] > limit then
      return {0, reasons[i]}
    end
  end
end
for i = 1, 4 do
  redis.call('INCRBY', KEYS[i], amounts[i])
  if redis.call('TTL', KEYS[i]) < 0 then
    if i <= 2 then redis.call('EXPIRE', KEYS[i], ARGV[7]) else redis.call('EXPIRE', KEYS[i], ARGV[8]) end
  end
end
return {1, ''}
"""

# Reconcile only keys that still exist: an expired window must not be resurrected by a late delta.
_RECONCILE_LUA = """
for i = 1, #KEYS do
  local delta = tonumber(ARGV[i])
  if delta ~= 0 and redis.call('EXISTS', KEYS[i]) == 1 then
    local value = redis.call('INCRBY', KEYS[i], delta)
    if value < 0 then redis.call('SET', KEYS[i], 0, 'KEEPTTL') end
  end
end
return 1
"""


class RedisQuotaStore:
    """A ledger shared by every gateway replica pointing at the same Redis."""

    name = "redis"

    def __init__(self, url: str, timeout_s: float = 0.5):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url = url
        # Fail fast when Redis is down (the policy decides allow/deny); the client reconnects on its
        # own on the next command, which is how the gateway recovers without a restart.
        self._client = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
            decode_responses=True,
        )
        self._reserve = self._client.register_script(_RESERVE_LUA)
        self._reconcile = self._client.register_script(_RECONCILE_LUA)

    async def _call(self, coro_factory):
        from redis.exceptions import RedisError

        try:
            return await coro_factory()
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"quota store (redis) unavailable: {exc.__class__.__name__}: {exc}") from exc

    async def reserve(
        self, tenant: str, limits: QuotaLimits, tokens: int, spend_micros: int, now: float | None = None
    ) -> Reservation:
        now = time.time() if now is None else now
        windows = Windows.at(now)
        _check_fits_at_all(limits, tokens, spend_micros, windows)
        keys = _keys(tenant, windows)
        args = [*_limit_args(limits), tokens, spend_micros, MINUTE_S * 2, DAY_S * 2]
        admitted, reason = await self._call(lambda: self._reserve(keys=keys, args=args))
        if int(admitted) != 1:
            raise _exceeded(str(reason), tenant, windows)
        return Reservation(tenant, tokens, spend_micros, windows)

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_spend_micros: int) -> None:
        deltas = _reconcile_deltas(reservation, actual_tokens, actual_spend_micros)
        if deltas is None or not any(delta for _, delta in deltas):
            return
        keys = [key for key, _ in deltas]
        args = [delta for _, delta in deltas]
        await self._call(lambda: self._reconcile(keys=keys, args=args))

    async def usage(self, tenant: str, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        keys = _keys(tenant, Windows.at(now))
        values = await self._call(lambda: self._client.mget(keys))
        names = ["requests_this_minute", "tokens_this_minute", "tokens_today", "spend_micros_today"]
        return {name: int(value or 0) for name, value in zip(names, values, strict=True)}

    async def ping(self) -> bool:
        try:
            return bool(await self._call(self._client.ping))
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        await self._client.aclose()


def _reconcile_deltas(
    reservation: Reservation, actual_tokens: int, actual_spend_micros: int
) -> list[tuple[str, int]] | None:
    """(key, delta) for tokens-per-minute, tokens-per-day and spend; None if nothing to reconcile.

    Marks the reservation reconciled, so a second call for the same request is a no-op.
    """
    if not reservation.recorded or reservation.reconciled or reservation.windows is None:
        return None
    reservation.reconciled = True
    _, tpm, tpd, spd = _keys(reservation.tenant, reservation.windows)
    token_delta = actual_tokens - reservation.tokens
    spend_delta = actual_spend_micros - reservation.spend_micros
    return [(tpm, token_delta), (tpd, token_delta), (spd, spend_delta)]


def create_store(redis_url: str | None) -> QuotaStore:
    return RedisQuotaStore(redis_url) if redis_url else InProcessQuotaStore()
