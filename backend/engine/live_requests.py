"""The engine thread's bookkeeping of the requests it runs: each one's stream, what reaches it, when
it ends.

Owned by the engine thread alone (`AsyncEngine._run`): it admits a queued request into the engine,
spreads each step's deltas over the consumers' event loops, hands a failed request its error and, when
the engine stops, fails every request still running. Everything reaches a consumer through its loop's
`call_soon_threadsafe`; a closed loop means the consumer is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctxgate.backend.engine.api import (
    EngineError,
    GenerationDelta,
    GenerationRequest,
    Priority,
    RequestMetrics,
)
from ctxgate.backend.engine.request_stream import RequestStream, deliver_all

if TYPE_CHECKING:
    from ctxgate.backend.engine.llm_engine import LLMEngine
    from ctxgate.backend.engine.metrics import EngineMetrics

logger = logging.getLogger(__name__)


@dataclass
class _StreamState:
    """Engine-thread bookkeeping for one live request."""

    stream: RequestStream
    # A shadow request's latency and tokens stay out of the live figures (EngineMetrics.shadow_requests).
    shadow: bool = False
    last_token_time: float | None = None


def send(stream: RequestStream, item: GenerationDelta | BaseException) -> None:
    """Hand one delta or error to its consumer, on the consumer's event loop."""
    try:
        stream.loop.call_soon_threadsafe(stream.deliver, item)
    except RuntimeError:
        pass  # the consumer's loop is closed


class LiveRequests:
    """The requests the engine runs, by id, each with the stream its consumer reads."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics, max_waiting_requests: int | None):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self._live: dict[str, _StreamState] = {}

    def add(self, request: GenerationRequest, stream: RequestStream) -> None:
        """Admit `request` into the engine, or answer its stream with the reason it is refused."""
        if stream.finished:  # the consumer left before the engine saw the request
            return
        if request.request_id in self._live:
            send(stream, EngineError(f"request id {request.request_id!r} is already running", 400))
            return
        if self.max_waiting_requests is not None:
            num_waiting = self.engine.stats().num_waiting
            if num_waiting >= self.max_waiting_requests:
                send(
                    stream,
                    EngineError(
                        f"the engine is overloaded ({num_waiting} requests waiting); retry later", 503
                    ),
                )
                return
        try:
            self.engine.add_request(request)
        except EngineError as exc:
            send(stream, exc)
            return
        except (ValueError, TypeError) as exc:
            send(stream, EngineError(str(exc), 400))
            return
        self._live[request.request_id] = _StreamState(
            stream=stream, shadow=request.priority is Priority.SHADOW
        )
        stream.loop.call_soon_threadsafe(stream.mark_accepted)

    def abort(self, request_id: str, notify: bool) -> None:
        """Abort a live request; with `notify` its consumer gets a final "abort" delta."""
        state = self._live.pop(request_id, None)
        if state is None:  # finished already, refused, or never reached the engine
            return
        self.engine.abort_request(request_id)
        final = GenerationDelta(
            request_id=request_id,
            text="",
            token_ids=[],
            finish_reason="abort",
            metrics=RequestMetrics(),
        )
        self.metrics.observe_finished(final, shadow=state.shadow)
        if notify:
            send(state.stream, final)

    def dispatch(self, deltas: list[GenerationDelta]) -> None:
        """Post one step's deltas to their consumers, one callback per event loop."""
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, GenerationDelta]]] = {}
        num_new_tokens = 0
        for delta in deltas:
            state = self._live.get(delta.request_id)
            if state is None or not state.shadow:
                num_new_tokens += len(delta.token_ids)
            if state is None:  # aborted between the step and now
                continue
            if delta.token_ids and not state.shadow:
                if state.last_token_time is not None:
                    # Tokens produced in one step share a timestamp; spread the gap over them.
                    gap = (now - state.last_token_time) / len(delta.token_ids)
                    for _ in delta.token_ids:
                        self.metrics.observe_inter_token(gap)
                state.last_token_time = now
            if delta.finish_reason is not None:
                del self._live[delta.request_id]
                self.metrics.observe_finished(delta, shadow=state.shadow)
            by_loop.setdefault(state.stream.loop, []).append((state.stream, delta))
        self.metrics.observe_step_tokens(num_new_tokens)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver_all, items)
            except RuntimeError:  # that event loop is closed; its consumers are gone
                for stream, delta in items:
                    if delta.finish_reason is None:
                        self._live.pop(stream.request_id, None)
                        self.engine.abort_request(stream.request_id)

    def deliver_failures(self, failures: list[tuple[str, EngineError]]) -> None:
        """Requests the step aborted because they failed: each consumer gets its request's error."""
        for request_id, error in failures:
            state = self._live.pop(request_id, None)
            if state is None:  # its consumer left already, or a second sequence of the same request
                continue
            self.metrics.observe_finished(
                GenerationDelta(request_id=request_id, text="", token_ids=[], finish_reason="error"),
                shadow=state.shadow,
            )
            send(state.stream, error)

    def fail_all(self, error: EngineError) -> None:
        """End every live request with `error` (the engine stopped, or its state is suspect)."""
        for request_id, state in list(self._live.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            send(state.stream, error)
        self._live.clear()
