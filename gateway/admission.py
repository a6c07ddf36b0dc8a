"""Admission control: a bounded number of requests in flight, a bounded queue, and draining.

Generation endpoints pass through `AdmissionControl` (pure ASGI, so a streamed response holds its
slot until its last byte). At most `max_in_flight` requests run; up to `max_queued` more wait for a
slot for at most `queue_timeout_s`. Anything beyond that, and every request once the gateway is
draining for shutdown, is answered at once with the documented overload answer:
503 `{"error": {"code": "overloaded"}}` with `Retry-After`. Memory therefore stays bounded under any
offered load, and clients are told when to come back instead of piling up.

The places are shared by every tenant, so one key must not be able to take them all:

- the key is checked from the headers before anything else (no key, or a bad one: 401 at once);
- the whole body is read (within the body size limit and read timeout) before a place is taken, so
  a client trickling its body holds a connection, never a slot another tenant's request could run in;
- one key may have at most `max_open_per_key` requests open (reading, queued or running) and at most
  `max_queued_per_key` of them waiting; beyond either it gets 429 `too_many_open_requests` /
  `too_many_queued_requests`, its own refusal, while other keys are admitted as before.

Under overload the places go by the tenants' weights (the keys file's `weight`, the same shares the
engine's fair queue uses; `admission_shares.py`). A tenant's load is its requests running and queued
per unit of weight: a freed slot goes to the waiter whose tenant's load is lowest, and when the queue
is full a newcomer whose tenant's load would stay below the most-loaded waiting tenant's takes the
place of that tenant's newest waiter, which gets the 503 instead. A tenant over its weighted share is
shed first; a quiet one still gets in.

A tenant's requests also share the gateway's CPU: while another tenant has requests open, one
tenant may use at most `tenant_cpu_share` of a core (its event-loop steps and compression work,
metered per request); a tenant over it waits, body unread, until it is back within
(`cpu_share.py`). A flood of requests that each end in a cheap 400 cannot keep the interpreter
from the engine's thread and every other tenant's requests.

Without keys (open mode) there is no key to count by: the global bounds alone apply, first come,
first served.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import ClientDisconnect

from ctxgate.backend.openai_api.errors import APIError
from ctxgate.gateway.admission_shares import Admittee, TenantShares
from ctxgate.gateway.cpu_share import TenantCpuShare, metered

# Paths whose requests reach the model; everything else (health, metrics, models) is never queued.
ADMITTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/ctxgate/compress")
CPU_WAIT_RECHECK_S = 0.25


@dataclass
class AdmissionStats:
    in_flight: int
    queued: int
    admitted: int
    rejected: int
    draining: bool


class Overloaded(Exception):
    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class KeyOverLimit(Overloaded):
    """One key's own admission limit (open or queued requests): a 429 for that key, not an overload."""

    def __init__(self, message: str, retry_after_s: int, code: str):
        super().__init__(message, retry_after_s)
        self.code = code


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[None]
    who: Admittee | None


class AdmissionController:
    """Counts requests in flight; a bounded queue of waiters gets freed slots by tenant share, then
    in arrival order."""

    def __init__(
        self,
        max_in_flight: int | None,
        max_queued: int = 0,
        queue_timeout_s: float = 5.0,
        retry_after_s: int = 1,
        max_queued_per_key: int | None = None,
    ):
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1 (or None for no limit)")
        if max_queued < 0:
            raise ValueError("max_queued must be >= 0")
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.admitted = 0
        self.rejected = 0
        self.draining = False
        self._waiters: list[_Waiter] = []
        self.max_queued_per_key = max_queued_per_key
        self._queued_by_key: dict[str, int] = {}
        self.shares = TenantShares()
        self.shed = 0  # waiters refused to make room for a tenant under its share

    def stats(self) -> AdmissionStats:
        return AdmissionStats(self.in_flight, len(self._waiters), self.admitted, self.rejected, self.draining)

    def start_draining(self) -> None:
        """Refuse new requests from now on; requests already admitted run to the end."""
        self.draining = True
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_exception(Overloaded("the gateway is shutting down", self.retry_after_s))
        self._waiters.clear()

    async def acquire(self, who: Admittee | None = None) -> None:
        """A slot, waiting for one in the queue if need be. `who`: the API key (whose waiting requests
        are capped at `max_queued_per_key`) and its tenant's share; None in open mode."""
        if self.draining:
            self.rejected += 1
            raise Overloaded("the gateway is shutting down; retry on another replica", self.retry_after_s)
        if self.max_in_flight is None or (self.in_flight < self.max_in_flight and not self._waiters):
            self._admit(who)
            return
        key = who.key if who is not None else None
        queued = self._queued_by_key.get(key, 0) if key is not None else 0
        if key is not None and self.max_queued_per_key is not None and queued >= self.max_queued_per_key:
            self.rejected += 1
            raise KeyOverLimit(
                f"this API key already has {queued} requests waiting for a slot "
                f"(max_queued_per_key); retry later",
                self.retry_after_s,
                "too_many_queued_requests",
            )
        if len(self._waiters) >= self.max_queued:
            self._shed_for(who)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), who)
        self._waiters.append(waiter)
        if key is not None:
            self._queued_by_key[key] = queued + 1
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.queue_timeout_s)
        except TimeoutError:
            self._drop_waiter(waiter)
            self.rejected += 1
            raise Overloaded(
                f"no capacity freed within {self.queue_timeout_s:g}s; retry later", self.retry_after_s
            ) from None
        except BaseException:
            self._drop_waiter(waiter)
            raise
        finally:
            if key is not None:
                _decrement(self._queued_by_key, key)
        # `release` handed its slot to this waiter: in_flight already counts it.
        self.admitted += 1

    def _shed_for(self, who: Admittee | None) -> None:
        """The queue is full: make room for `who` by refusing the newest waiter of the tenant most over
        its weighted share, or refuse `who` when no waiting tenant holds more than it would."""
        victim = self.shares.victim([waiter.who for waiter in self._waiters], who)
        if victim is None:
            self.rejected += 1
            raise Overloaded(
                f"the gateway is at capacity ({self.in_flight} requests running, {len(self._waiters)} queued); "
                "retry later",
                self.retry_after_s,
            )
        waiter = self._waiters.pop(victim)
        self.shed += 1
        self.rejected += 1
        waiter.future.set_exception(
            Overloaded(
                "the gateway is at capacity and this tenant holds more than its weighted share of it; "
                "retry later",
                self.retry_after_s,
            )
        )

    def _admit(self, who: Admittee | None) -> None:
        self.in_flight += 1
        self.admitted += 1
        self.shares.started(who)

    def _drop_waiter(self, waiter: _Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        elif waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            # The slot was handed over just as the waiter gave up: give it back.
            self.release(waiter.who)

    def release(self, who: Admittee | None = None) -> None:
        """`who`'s request is done: its slot passes to the waiter whose tenant's load is lowest (the
        oldest of those), or is freed."""
        self.shares.finished(who)
        while self._waiters:
            waiter = self._waiters.pop(self.shares.next_in_line([waiter.who for waiter in self._waiters]))
            if not waiter.future.done():
                waiter.future.set_result(None)  # the slot passes straight to this waiter
                self.shares.started(waiter.who)
                return
        self.in_flight -= 1


def _decrement(counts: dict[str, int], key: str) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]  # keys with nothing open take no memory


def overloaded_response(exc: Overloaded) -> APIError:
    headers = {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, KeyOverLimit):
        return APIError(429, str(exc), code=exc.code, error_type="rate_limit_error", headers=headers)
    return APIError(503, str(exc), code="overloaded", error_type="overloaded_error", headers=headers)


# Who sends a request, from its headers: its API key's id and its tenant's share (None in open mode);
# raises APIError (401) for a missing or invalid key.
KeyOf = Callable[[dict[bytes, bytes]], Admittee | None]


class AdmissionControl:
    """ASGI middleware holding one admission slot for the whole life of a generation request, taken
    once the key is known good and the body is in (see the module docstring). Sits inside the body
    size limit, whose 413/408 it answers for the body it reads."""

    def __init__(
        self,
        app,
        controller: AdmissionController,
        key_of: KeyOf | None = None,
        max_open_per_key: int | None = None,
        cpu_share: TenantCpuShare | None = None,
    ):
        self.app = app
        self.controller = controller
        self.key_of = key_of
        self.max_open_per_key = max_open_per_key
        self.cpu_share = cpu_share
        self._open_by_key: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in ADMITTED_PATHS
        ):
            return await self.app(scope, receive, send)
        try:
            who = self.key_of(dict(scope.get("headers") or [])) if self.key_of is not None else None
            self._open(who)
        except APIError as exc:
            return await exc.response()(scope, receive, send)
        except Overloaded as exc:
            return await overloaded_response(exc).response()(scope, receive, send)
        try:
            if who is None or self.cpu_share is None:
                return await self._admit(scope, receive, send, who)
            return await self._admit_sharing_cpu(scope, receive, send, who, self.cpu_share)
        finally:
            if who is not None:
                _decrement(self._open_by_key, who.key)

    async def _admit_sharing_cpu(
        self, scope, receive, send, who: Admittee, cpu_share: TenantCpuShare
    ) -> None:
        cpu_share.opened(who.tenant)
        try:
            await self._wait_for_cpu(who.tenant, cpu_share)
            charge = functools.partial(cpu_share.charge, who.tenant)
            return await metered(self._admit(scope, receive, send, who), charge)
        finally:
            cpu_share.closed(who.tenant)

    async def _wait_for_cpu(self, tenant: str, cpu_share: TenantCpuShare) -> None:
        """Hold a tenant in CPU debt back while another tenant has requests open (cpu_share.py); its
        body stays unread meanwhile. Re-checked often: the wait ends early when the others leave."""
        started = time.perf_counter()
        while (wait_s := cpu_share.wait_s(tenant)) > 0:
            await asyncio.sleep(min(wait_s, CPU_WAIT_RECHECK_S))
        if (waited_s := time.perf_counter() - started) > 0.001:
            cpu_share.waited(tenant, waited_s)

    def _open(self, who: Admittee | None) -> None:
        if who is None:
            return
        count = self._open_by_key.get(who.key, 0)
        if self.max_open_per_key is not None and count >= self.max_open_per_key:
            self.controller.rejected += 1
            raise KeyOverLimit(
                f"this API key already has {count} requests open (max_open_per_key); retry later",
                self.controller.retry_after_s,
                "too_many_open_requests",
            )
        self._open_by_key[who.key] = count + 1

    async def _admit(self, scope, receive, send, who: Admittee | None) -> None:
        try:
            body = await _read_body(receive)
        except APIError as exc:  # over the size limit, or not received in time
            return await exc.response()(scope, receive, send)
        if body is None:
            return None  # the client left while sending its body: nobody to answer
        started = time.perf_counter()
        try:
            await self.controller.acquire(who)
        except Overloaded as exc:
            return await overloaded_response(exc).response()(scope, receive, send)
        scope.setdefault("state", {})["admission_wait_s"] = time.perf_counter() - started
        try:
            return await self.app(scope, _replay(body, receive), send)
        except ClientDisconnect:
            return None  # the client left while queued or running: nobody to answer
        finally:
            self.controller.release(who)


async def _read_body(receive: Callable[[], Awaitable[dict]]) -> bytes | None:
    """The whole request body; None when the client disconnects first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Callable[[], Awaitable[dict]]) -> Callable[[], Awaitable[dict]]:
    """A `receive` that gives the app the body already read, then waits on the client (disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict:
        return pending.pop() if pending else await receive()

    return replay


class AdmissionCollector:
    """Exports the controller's live state at scrape time (nothing to keep in sync on the hot path)."""

    def __init__(self, controller: AdmissionController, cpu_share: TenantCpuShare | None = None):
        self.controller = controller
        self.cpu_share = cpu_share

    def describe(self):
        return list(self.collect())

    def collect(self):
        stats = self.controller.stats()
        yield GaugeMetricFamily(
            "ctxgate:admission_in_flight", "generation requests holding a slot", stats.in_flight
        )
        yield GaugeMetricFamily("ctxgate:admission_queued", "requests waiting for a slot", stats.queued)
        limit = self.controller.max_in_flight
        yield GaugeMetricFamily(
            "ctxgate:admission_max_in_flight", "slots (-1: no limit)", -1 if limit is None else limit
        )
        yield GaugeMetricFamily("ctxgate:admission_max_queued", "queue bound", self.controller.max_queued)
        yield GaugeMetricFamily("ctxgate:admission_draining", "1 while shutting down", int(stats.draining))
        yield CounterMetricFamily("ctxgate:admission_admitted", "requests given a slot", stats.admitted)
        yield CounterMetricFamily(
            "ctxgate:admission_rejected", "requests refused with 503 (full or draining)", stats.rejected
        )
        yield CounterMetricFamily(
            "ctxgate:admission_shed",
            "queued requests refused with 503 to make room for a tenant under its weighted share",
            self.controller.shed,
        )
        if self.cpu_share is not None:
            yield _per_tenant(
                "ctxgate:tenant_cpu_seconds",
                "gateway CPU spent on the tenant's requests (event loop and compression workers)",
                self.cpu_share.charged_s,
            )
            yield _per_tenant(
                "ctxgate:tenant_cpu_wait_seconds",
                "time the tenant's requests waited for its CPU share while other tenants had requests open",
                self.cpu_share.waited_s,
            )


def _per_tenant(name: str, documentation: str, seconds: dict[str, float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["tenant"])
    for tenant, value in sorted(seconds.items()):
        family.add_metric([tenant], value)
    return family
