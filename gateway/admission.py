"""Admission control: a bounded number of requests in flight, a bounded queue, and draining.

Generation endpoints pass through `AdmissionControl` (pure ASGI, so a streamed response holds its
slot until its last byte). At most `max_in_flight` requests run; up to `max_queued` more wait for a
slot for at most `queue_timeout_s`. Anything beyond that, and every request once the gateway is
draining for shutdown, is answered at once with the documented overload answer:
503 `{"error": {"code": "overloaded"}}` with `Retry-After`. Memory therefore stays bounded under any
offered load, and clients are told when to come back instead of piling up.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import ClientDisconnect

from backend.openai_api.errors import APIError

# Paths whose requests reach the model; everything else (health, metrics, models) is never queued.
ADMITTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/ctxgate/compress")


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


class AdmissionController:
    """Counts requests in flight; a bounded FIFO of waiters gets freed slots in arrival order."""

    def __init__(self, max_in_flight: int | None, max_queued: int = 0, queue_timeout_s: float = 5.0,
                 retry_after_s: int = 1):
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
        self._waiters: list[asyncio.Future[None]] = []

    def stats(self) -> AdmissionStats:
        return AdmissionStats(self.in_flight, len(self._waiters), self.admitted, self.rejected, self.draining)

    def start_draining(self) -> None:
        """Refuse new requests from now on; requests already admitted run to the end."""
        self.draining = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(Overloaded("the gateway is shutting down", self.retry_after_s))
        self._waiters.clear()

    async def acquire(self) -> None:
        if self.draining:
            self.rejected += 1
            raise Overloaded("the gateway is shutting down; retry on another replica", self.retry_after_s)
        if self.max_in_flight is None or (self.in_flight < self.max_in_flight and not self._waiters):
            self._admit()
            return
        if len(self._waiters) >= self.max_queued:
            self.rejected += 1
            raise Overloaded(
                f"the gateway is at capacity ({self.in_flight} requests running, {len(self._waiters)} queued); "
                "retry later", self.retry_after_s,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except TimeoutError:
            self._drop_waiter(waiter)
            self.rejected += 1
            raise Overloaded(
                f"no capacity freed within {self.queue_timeout_s:g}s; retry later", self.retry_after_s
            ) from None
        except BaseException:
            self._drop_waiter(waiter)
            raise
        # `release` handed its slot to this waiter: in_flight already counts it.
        self.admitted += 1

    def _admit(self) -> None:
        self.in_flight += 1
        self.admitted += 1

    def _drop_waiter(self, waiter: asyncio.Future[None]) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        elif waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            # The slot was handed over just as the waiter gave up: give it back.
            self.release()

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next waiter
                return
        self.in_flight -= 1


def overloaded_response(exc: Overloaded) -> APIError:
    return APIError(503, str(exc), code="overloaded", error_type="overloaded_error",
                    headers={"Retry-After": str(exc.retry_after_s)})


class AdmissionControl:
    """ASGI middleware holding one admission slot for the whole life of a generation request."""

    def __init__(self, app, controller: AdmissionController):
        self.app = app
        self.controller = controller

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in ADMITTED_PATHS:
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        try:
            await self.controller.acquire()
        except Overloaded as exc:
            return await overloaded_response(exc).response()(scope, receive, send)
        scope.setdefault("state", {})["admission_wait_s"] = time.perf_counter() - started
        try:
            return await self.app(scope, receive, send)
        except ClientDisconnect:
            return None  # the client left while its body was read (often while queued): nobody to answer
        finally:
            self.controller.release()


class AdmissionCollector:
    """Exports the controller's live state at scrape time (nothing to keep in sync on the hot path)."""

    def __init__(self, controller: AdmissionController):
        self.controller = controller

    def describe(self):
        return list(self.collect())

    def collect(self):
        stats = self.controller.stats()
        yield GaugeMetricFamily("ctxgate:admission_in_flight", "generation requests holding a slot", stats.in_flight)
        yield GaugeMetricFamily("ctxgate:admission_queued", "requests waiting for a slot", stats.queued)
        limit = self.controller.max_in_flight
        yield GaugeMetricFamily("ctxgate:admission_max_in_flight", "slots (-1: no limit)",
                                -1 if limit is None else limit)
        yield GaugeMetricFamily("ctxgate:admission_max_queued", "queue bound", self.controller.max_queued)
        yield GaugeMetricFamily("ctxgate:admission_draining", "1 while shutting down", int(stats.draining))
        yield CounterMetricFamily("ctxgate:admission_admitted", "requests given a slot", stats.admitted)
        yield CounterMetricFamily("ctxgate:admission_rejected", "requests refused with 503 (full or draining)",
                                  stats.rejected)
