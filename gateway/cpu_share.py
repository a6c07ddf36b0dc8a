"""Each tenant's share of the gateway's CPU while other tenants have requests open.

The gateway's Python (the event loop, the compression workers) and the in-process engine's thread
take turns on one interpreter lock: a tenant that keeps the event loop busy at full speed, even with
requests that end in a cheap 400, makes every other tenant's prefill wait for the lock at each op.
So the CPU time spent on a tenant's requests is metered (`metered`: every step of a request's
coroutine on the event loop; `charge` from the compression workers at their yield points,
compression/fair.py). Each tenant holds a credit of CPU seconds, refilled at `share` seconds per
second up to `burst_s`; CPU spent while another tenant has requests open is taken from it after the
fact (a long step leaves a debt). A tenant in debt waits, its next request before its body is read
and its running compression at its next yield point, until the refill has brought it level with the
open tenant that has used the least lately (at most: out of debt). So beside light tenants a
flooding one gets `share` of a core, tenants that are all busy take turns, and a tenant alone on the
gateway is never held back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_SHARE = 0.1
DEFAULT_BURST_S = 0.05

MAX_REMEMBERED = 4096  # tenants whose credit is kept; beyond, those with full credit are forgotten


@dataclass
class _Credit:
    seconds: float
    updated: float


class TenantCpuShare:
    """Per-tenant CPU credit, shared by the event loop and the compression worker threads:
    `charge` takes CPU seconds, `wait_s` says how long the tenant waits now (0 when in credit, or
    when no other tenant has requests open: `opened`/`closed` count them)."""

    def __init__(
        self,
        share: float = DEFAULT_SHARE,
        burst_s: float = DEFAULT_BURST_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a tenant's CPU share must be above 0 and at most 1, not {share}")
        if burst_s <= 0:
            raise ValueError(f"the CPU burst must be above 0 seconds, not {burst_s}")
        self.share = share
        self.burst_s = burst_s
        self._clock = clock
        self._lock = threading.Lock()
        self._credits: dict[str, _Credit] = {}
        self._open: dict[str, int] = {}  # requests open per tenant
        self.charged_s: dict[str, float] = {}  # per tenant, for /metrics
        self.waited_s: dict[str, float] = {}

    def opened(self, tenant: str) -> None:
        with self._lock:
            self._open[tenant] = self._open.get(tenant, 0) + 1

    def closed(self, tenant: str) -> None:
        with self._lock:
            self._open[tenant] -= 1
            if self._open[tenant] <= 0:
                del self._open[tenant]

    def charge(self, tenant: str, seconds: float) -> None:
        """Take CPU seconds from the tenant's credit; alone on the gateway it runs into no new debt
        (it took the CPU from no one)."""
        if seconds <= 0:
            return
        with self._lock:
            credit = self._refilled(tenant)
            floor = min(credit.seconds, 0.0) if not self._others_open(tenant) else -float("inf")
            credit.seconds = max(credit.seconds - seconds, floor)
            self.charged_s[tenant] = self.charged_s.get(tenant, 0.0) + seconds

    def wait_s(self, tenant: str) -> float:
        """How long the tenant waits now: while in debt, until it has paid off its debt, or as much of
        it as brings it level with the open tenant that has used the least lately. So a tenant
        flooding beside light ones runs at `share` of a core, and tenants that are all busy take
        turns by who used less (one of them always runs)."""
        with self._lock:
            credit = self._refilled(tenant)
            if credit.seconds >= 0:
                return 0.0
            others = [self._refilled(name).seconds for name in self._open if name != tenant]
            if not others:
                return 0.0
            return max(0.0, min(max(others), 0.0) - credit.seconds) / self.share

    def _others_open(self, tenant: str) -> bool:
        return len(self._open) > 1 or (len(self._open) == 1 and tenant not in self._open)

    def waited(self, tenant: str, seconds: float) -> None:
        with self._lock:
            self.waited_s[tenant] = self.waited_s.get(tenant, 0.0) + seconds

    def _refilled(self, tenant: str) -> _Credit:
        now = self._clock()
        credit = self._credits.get(tenant)
        if credit is None:
            if len(self._credits) >= MAX_REMEMBERED:
                self._forget_full()
            credit = self._credits[tenant] = _Credit(self.burst_s, now)
        else:
            credit.seconds = min(self.burst_s, credit.seconds + (now - credit.updated) * self.share)
            credit.updated = now
        return credit

    def _forget_full(self) -> None:
        # A tenant with full credit is where a new one starts: forgetting it loses nothing.
        for tenant in [name for name, credit in self._credits.items() if credit.seconds >= self.burst_s]:
            del self._credits[tenant]


async def metered(awaitable: Awaitable[T], charge: Callable[[float], None]) -> T:
    """Await `awaitable`, passing the event loop's CPU time of each of its steps to `charge`."""
    return await _Metered(awaitable.__await__(), charge)


class _Metered:
    """An awaitable that runs another's steps, timing each with the thread's CPU clock."""

    def __init__(self, inner: Generator[Any, Any, Any], charge: Callable[[float], None]) -> None:
        self._inner = inner
        self._charge = charge

    def __await__(self) -> Generator[Any, Any, Any]:
        inner, charge = self._inner, self._charge
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            started = time.thread_time()
            try:
                yielded = inner.send(sent) if thrown is None else inner.throw(thrown)
            except StopIteration as done:
                return done.value
            finally:
                charge(time.thread_time() - started)
            try:
                sent, thrown = (yield yielded), None
            except GeneratorExit:
                inner.close()
                raise
            except BaseException as exc:  # cancellation and the like go to the request's code
                sent, thrown = None, exc
