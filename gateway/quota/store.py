"""What the gateway needs of a quota ledger (`QuotaStore`) and the clock a ledger reads.

Invariants every store keeps:

- `reserve` checks every meter and applies all of them or none, atomically with respect to every
  other reservation on the same ledger (so replicas sharing one never exceed a limit by more than
  what one reconcile can add afterwards: one request's reservation).
- The windows a call falls in come from `now` when given, otherwise from the store's clock (and the
  quota's time zone); nothing else decides which minute, second, day, week, month or budget period a
  request is counted in (or its Retry-After).
- `check` reads the same meters `reserve` would and changes nothing.
- `reconcile` applies a reservation's deltas at most once, never to a window that has already
  expired, and never below zero.
- Failing to reach the ledger raises `StoreUnavailable`, never anything else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ctxgate.gateway.quota.model import LimitUsage, QuotaLimits, Reservation

# Seconds since the epoch, as time.time gives them. Injectable so tests own time instead of
# waiting for the wall clock.
Clock = Callable[[], float]


class QuotaStore(Protocol):
    name: str

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
    ) -> Reservation: ...

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
        """Raise `QuotaExceeded` where `reserve` would (parallel slots only counted), applying nothing:
        the cheap refusal before a request's expensive work."""
        ...

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
        """The tokens a reservation could still take under every token limit (None: no token limit).
        A read only: `reserve` stays the atomic decision."""
        ...

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
        """The spend (micro-units) a reservation could still take under every spend limit (None: no
        spend limit). A read only, like `tokens_left`."""
        ...

    async def reconcile(
        self, reservation: Reservation, actual_tokens: int, actual_spend_micros: int
    ) -> None: ...

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
        """Every limit these scopes have (what `reserve` would check), as used now: a read only."""
        ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...
