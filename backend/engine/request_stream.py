"""The consumer side of one engine request: an async iterator of deltas, fed from the engine's thread.

Items arrive through the consumer's event loop (`loop.call_soon_threadsafe`); an `EngineError` refusing
the request arrives as the very first item. Closing an unfinished stream aborts its request (freeing
its KV blocks); closing is idempotent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ctxgate.backend.engine.api import GenerationDelta


class RequestStream:
    """The consumer side of one request: an async iterator of deltas.

    Items put on the queue are deltas, or an exception that the iterator raises (an `EngineError`
    refusing the request arrives as the very first item, before any delta).
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, on_close: Callable[[], None]):
        self.request_id = request_id
        self.loop = loop  # the consumer's: the engine thread delivers through it
        self._on_close = on_close
        self._queue: asyncio.Queue[GenerationDelta | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.finished = False

    # --- engine-thread side (always through loop.call_soon_threadsafe) ---
    def deliver(self, item: GenerationDelta | BaseException) -> None:
        if isinstance(item, BaseException) and not self.accepted.done():
            self.accepted.set_exception(item)
            # Nobody may ever await `accepted` (e.g. generate() awaits the queue instead).
            self.accepted.exception()
        elif not self.accepted.done():
            self.accepted.set_result(None)
        self._queue.put_nowait(item)

    def mark_accepted(self) -> None:
        if not self.accepted.done():
            self.accepted.set_result(None)

    # --- consumer side ---
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            # Cancelled while waiting (client went away): free the request's KV blocks.
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finish_reason is not None:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it already finished. Idempotent; safe from any coroutine."""
        if not self.finished:
            self.finished = True
            self._on_close()


def deliver_all(items: list[tuple[RequestStream, GenerationDelta]]) -> None:
    for stream, delta in items:
        stream.deliver(delta)
