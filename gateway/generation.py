"""One request on the engine: consume its deltas, answer whole or streamed, settle its usage.

Every request that reserved quota is settled exactly once (whole answer, stream end, error, or client
disconnect), and a request the engine never started gives its whole reservation back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ctxgate.backend.engine.api import EngineClient, GenerationDelta, GenerationRequest
from ctxgate.backend.engine.deltas import DeltaTotals
from ctxgate.backend.openai_api.errors import APIError, ClientDisconnected
from ctxgate.backend.openai_api.http import unless_disconnected
from ctxgate.backend.openai_api.responses import ResponseWriter, Usage, fold_chunks
from ctxgate.backend.openai_api.sse import DONE, event_stream_response, sse_event
from ctxgate.gateway.metrics import GatewayMetrics
from ctxgate.gateway.prepared import Prepared


class Settlement(Protocol):
    """The quota's end of a request (`ctxgate.gateway.accounting.Accounting`)."""

    async def settle(self, prepared: Prepared, totals: DeltaTotals, count_metrics: bool = True) -> Usage:
        """Reconcile with what ran and return `usage`."""
        ...

    async def release(self, prepared: Prepared) -> None:
        """Give the whole reservation back: the engine never started the request."""
        ...


@dataclass(frozen=True)
class GenerationServices:
    """What running a prepared request needs of the gateway, and nothing more."""

    engine: EngineClient
    # A request's whole life, from its arrival at the gateway; None: unbounded.
    timeout_s: float | None
    settlement: Settlement
    # Tells the budget controller that a request is no longer queued for prefill (by request id).
    first_token: Callable[[str], None]
    metrics: GatewayMetrics
    # The client's answer for a failed generation (`ctxgate.gateway.engine_errors`).
    engine_error: Callable[[Exception], APIError]
    # A request answered in full and settled: the shadow comparison's cue (`ShadowRunner.after_live`);
    # it must return at once.
    answered: Callable[[Prepared, GenerationRequest, DeltaTotals], None] = lambda *_: None


class Generation:
    """Consumes the engine's deltas for one request and keeps what usage needs."""

    def __init__(self, services: GenerationServices, prepared: Prepared, generation: GenerationRequest):
        self.services = services
        self.prepared = prepared
        self.generation = generation
        self.totals = DeltaTotals()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        # Upstream mode: the upstream's chunks, relayed as they are (and folded when not streamed).
        self.relayed = generation.forward is not None
        self.chunks: list[dict[str, Any]] = []
        self.upstream_id: str | None = None
        self._iterator: Any = None
        self._first: Any = None

    async def start(self) -> None:
        """Open the engine stream and wait for its first delta, so a refusal becomes an HTTP status."""
        self._iterator = _bounded(
            self.services.engine.generate(self.generation), self.services.timeout_s, self.prepared.received_at
        )
        try:
            self._first = await self._iterator.__anext__()
        except StopAsyncIteration:
            self._first = None
        except BaseException:
            await self._stop_engine()
            raise
        finally:
            # Its prefill is done (or never will be): no longer queued in the budget controller's eyes.
            self.services.first_token(self.prepared.request_id)

    async def _stop_engine(self) -> None:
        # The client went away or the backend failed: stop the work upstream.
        with contextlib.suppress(Exception):
            await self._iterator.aclose()
        with contextlib.suppress(Exception):
            await self.services.engine.abort(self.generation.request_id)

    def _take(self, delta: GenerationDelta) -> GenerationDelta:
        if delta.raw is not None:
            self.chunks.append(delta.raw)
            self.upstream_id = self.upstream_id or delta.raw.get("id")
        if delta.text or delta.token_ids:
            now = time.perf_counter()
            self.first_token_at = self.first_token_at or now
            self.prepared.first_token_at = self.first_token_at
            self.last_token_at = now
        self.totals.add(delta)
        return delta

    async def deltas(self) -> AsyncIterator[GenerationDelta]:
        """The engine's deltas, each added to `totals` first (finish reasons, counts, metrics)."""
        if self._iterator is None:
            await self.start()
        assert self._iterator is not None  # start() opened the engine stream
        try:
            if self._first is not None:
                first, self._first = self._first, None
                yield self._take(first)
            if not self.totals.finished:
                async for delta in self._iterator:
                    yield self._take(delta)
        finally:
            if not self.totals.finished:
                await self._stop_engine()

    def relayed_chunks(self) -> list[dict[str, Any]]:
        """Upstream chunks not yet sent to a streaming client (taken: each is sent once)."""
        chunks, self.chunks = self.chunks, []
        return chunks

    def usage_body(self, usage: Usage) -> dict[str, Any]:
        """`usage` as the client gets it: the upstream's own object plus `ctxgate` when relaying."""
        if self.relayed and self.totals.upstream_usage:
            return {**self.totals.upstream_usage, "ctxgate": usage.model_extra.get("ctxgate")}
        return usage.model_dump()

    async def drain(self) -> None:
        """Run the request to the end, keeping only what `totals` records."""
        async for _ in self.deltas():
            pass

    def observe_latency(self, endpoint: str) -> None:
        metrics = self.services.metrics
        started = self.prepared.received_at
        if self.first_token_at is not None:
            metrics.ttft_seconds.observe(self.first_token_at - started)
            if self.totals.completion_tokens > 1 and self.last_token_at is not None:
                metrics.tpot_seconds.observe(
                    (self.last_token_at - self.first_token_at) / (self.totals.completion_tokens - 1)
                )
        metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - started)


async def _bounded(
    iterator: AsyncIterator[Any], timeout_s: float | None, started: float
) -> AsyncIterator[Any]:
    """`iterator`, raising TimeoutError once `timeout_s` has passed since `started` (perf_counter)."""
    try:
        if timeout_s is None:
            async for item in iterator:
                yield item
            return
        loop = asyncio.get_running_loop()
        # One deadline on the loop's clock; a timer per token (asyncio.timeout_at) instead of a new
        # task per token (asyncio.wait_for), which showed in the per-token cost of streaming.
        deadline = loop.time() + started + timeout_s - time.perf_counter()
        while True:
            if loop.time() >= deadline:
                raise TimeoutError(f"the request took longer than {timeout_s:g}s")
            try:
                async with asyncio.timeout_at(deadline):
                    item = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise TimeoutError(f"the request took longer than {timeout_s:g}s") from None
            yield item
    finally:
        with contextlib.suppress(Exception):
            await iterator.aclose()  # closing the wrapper closes the engine stream (frees its blocks)


async def complete(request: Request, run: Generation, writer: ResponseWriter) -> JSONResponse:
    services, prepared = run.services, run.prepared
    try:
        await unless_disconnected(request, run.drain())
    except ClientDisconnected:  # generation was cancelled (which aborted it upstream): bill what ran
        await services.settlement.settle(prepared, run.totals, count_metrics=False)
        raise
    except Exception as exc:
        if run.first_token_at is None:
            await services.settlement.release(prepared)  # the backend did no work: give the quota back
        else:
            await services.settlement.settle(prepared, run.totals, count_metrics=False)
        raise services.engine_error(exc) from None
    usage = await services.settlement.settle(prepared, run.totals)
    run.observe_latency(request.url.path)
    services.answered(prepared, run.generation, run.totals)
    if run.relayed:  # the upstream's answer as it is; only the model name (rewritten going up) and usage
        whole = fold_chunks(run.chunks, writer.chat) | {"model": writer.model, "usage": run.usage_body(usage)}
        return JSONResponse(whole)
    for index in range(prepared.choices):
        run.totals.choice(index)
    return JSONResponse(writer.whole_choices(run.totals.ordered_choices(), usage))


async def stream(
    request: Request,
    run: Generation,
    writer: ResponseWriter,
    endpoint: str,
    include_usage: bool,
    num_choices: int = 1,
) -> StreamingResponse:
    try:
        # Nothing is sent before the first token: a client that gives up while its request waits in
        # the engine's queue would otherwise keep its place there and have its prompt prefilled.
        await unless_disconnected(request, run.start())
    except ClientDisconnected:  # start() was cancelled, which aborted the request in the engine
        await run.services.settlement.release(run.prepared)
        raise
    except Exception as exc:
        await run.services.settlement.release(run.prepared)  # refused before any work: give the quota back
        raise run.services.engine_error(exc) from None
    return event_stream_response(_events(run, writer, endpoint, include_usage, num_choices))


async def _events(
    run: Generation, writer: ResponseWriter, endpoint: str, include_usage: bool, num_choices: int
) -> AsyncIterator[str]:
    services, prepared = run.services, run.prepared
    settled = False
    try:
        for event in [] if run.relayed else writer.opening(num_choices):
            yield event
        try:
            async for delta in run.deltas():
                for event in [] if run.relayed else writer.delta_events(delta, run.totals):
                    yield event
                for chunk in run.relayed_chunks():
                    yield _relay(chunk, writer)
        except Exception as exc:  # headers are sent: report in-band, as OpenAI does
            yield sse_event(services.engine_error(exc).body())
            yield DONE
            return
        usage = await services.settlement.settle(prepared, run.totals)
        settled = True
        run.observe_latency(endpoint)
        services.answered(prepared, run.generation, run.totals)
        for chunk in run.relayed_chunks():  # chunks after the last text (tool calls, the finish reason)
            yield _relay(chunk, writer)
        for choice in [] if run.relayed else run.totals.ordered_choices():
            if choice.finish_reason is None:  # the engine ended without finishing it
                for event in writer.choice_end(choice):
                    yield event
        if include_usage and run.relayed:  # the upstream's envelope (id, created), the gateway's usage
            yield sse_event(
                {
                    "id": run.upstream_id or writer.response_id,
                    "object": "chat.completion.chunk" if writer.chat else "text_completion",
                    "created": writer.created,
                    "model": writer.model,
                    "choices": [],
                    "usage": run.usage_body(usage),
                }
            )
        elif include_usage:
            yield writer.usage(usage)
        yield DONE
    finally:
        if not settled:
            await asyncio.shield(services.settlement.settle(prepared, run.totals, count_metrics=False))


def _relay(chunk: dict[str, Any], writer: ResponseWriter) -> str:
    """An upstream chunk as it came, under the model name the client asked for; usage is sent once,
    at the end, with the gateway's accounting added."""
    return sse_event({key: value for key, value in chunk.items() if key != "usage"} | {"model": writer.model})
