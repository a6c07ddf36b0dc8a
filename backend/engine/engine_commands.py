"""The engine thread's inbox: what the event loop asks of the engine (add, abort, stop), in order.

Between steps every command applies. Between two decoder layers of a step in progress (a nested
prefill may start there: `interleaved_prefill.py`) only the adds at the front of the inbox do: an
add touches the waiting queue alone, while an abort or a stop could take a sequence out of the
step's fixed batch. The first other command is held, with everything after it, until the step ends,
so the engine still sees every command in the order it was sent.
"""

from __future__ import annotations

import queue
from collections import deque
from dataclasses import dataclass
from typing import Any

from ctxgate.backend.engine.api import GenerationRequest
from ctxgate.backend.engine.request_stream import RequestStream


class Stop:
    """Command that ends the engine thread."""


@dataclass
class Add:
    request: GenerationRequest
    stream: RequestStream


@dataclass
class Abort:
    request_id: str
    # Explicit aborts (not the consumer leaving) tell the consumer with a final "abort" delta.
    notify: bool


WAKE = object()  # a command that only wakes an idle engine thread (a job is queued)


class CommandQueue:
    """Thread-safe for `put`; `get` and `adds_mid_step` are the engine thread's."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._held: deque[Any] = deque()  # taken off the queue mid-step, applied after the step

    def put(self, command: Any) -> None:
        self._queue.put(command)

    def get(self, block: bool) -> Any:
        """The next command; raises queue.Empty when none is queued (and `block` is False)."""
        if self._held:
            return self._held.popleft()
        return self._queue.get(block=block)

    def adds_mid_step(self) -> list[Add]:
        """The adds at the front of the inbox; the first other command and all after it are held."""
        adds: list[Add] = []
        while not self._held and not self._queue.empty():
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Add):
                adds.append(command)
            elif command is not WAKE:  # the thread is awake: a wake-up is spent
                self._held.append(command)
        return adds
