"""Micro-batching of embedding work: concurrent requests' sentences go through the model together.

Every compression that needs vectors for texts not in the cache hands them to one `EmbedBatcher`
thread. The thread takes the first waiting call, waits up to `window_ms` for more (requests that
arrived together usually ask within a few milliseconds of each other), encodes the union once
(texts asked twice are encoded once) and hands each caller its rows. One encode of 200 sentences
costs much less than four of 50 (fixed per-call overhead, better matmul shapes), and only this one
thread runs the embedding model, with its own small OpenMP budget (`threads`), so the embedder
never starts a second OpenMP team beside the engine's (backend/openmp.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

Encode = Callable[[list[str]], np.ndarray]


@dataclass
class _Call:
    texts: list[str]
    future: Future[np.ndarray] = field(default_factory=Future)


class EmbedBatcher:
    """Coalesces concurrent `encode(texts)` calls into one model call per batch window."""

    def __init__(self, encode: Encode, window_ms: float = 3.0, max_batch_texts: int = 512, threads: int = 1):
        self._encode = encode
        self.window_s = max(0.0, window_ms) / 1000
        self.max_batch_texts = max_batch_texts
        self.threads = threads
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="ctxgate-embed", daemon=True)
        self._thread.start()
        # Observability (and the tests): how many model calls served how many caller calls.
        self.batches = 0
        self.calls = 0

    def encode(self, texts: list[str]) -> np.ndarray:
        """Rows for `texts`, in order; blocks the calling thread until its batch ran."""
        if not texts:
            raise ValueError("encode needs at least one text")
        call = _Call(list(texts))
        self._calls.put(call)
        return call.future.result()

    def close(self) -> None:
        self._calls.put(None)
        self._thread.join(timeout=10)

    # -- the batching thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        from backend import openmp

        openmp.limit_calling_thread(self.threads)
        while True:
            first = self._calls.get()
            if first is None:
                return
            batch, stop = self._collect(first)
            self._run(batch)
            if stop:
                return

    def _collect(self, first: _Call) -> tuple[list[_Call], bool]:
        """The first call plus whatever else arrives within the window (or until the batch is full)."""
        batch = [first]
        size = len(first.texts)
        deadline = time.monotonic() + self.window_s
        while size < self.max_batch_texts:
            remaining = deadline - time.monotonic()
            try:
                call = self._calls.get(timeout=remaining) if remaining > 0 else self._calls.get_nowait()
            except queue.Empty:
                break
            if call is None:
                return batch, True
            batch.append(call)
            size += len(call.texts)
        return batch, False

    def _run(self, batch: list[_Call]) -> None:
        unique = list(dict.fromkeys(text for call in batch for text in call.texts))
        try:
            vectors = self._encode(unique)
        except BaseException as exc:  # every caller must be woken, with the error
            for call in batch:
                call.future.set_exception(exc)
            return
        row = {text: index for index, text in enumerate(unique)}
        for call in batch:
            call.future.set_result(vectors[[row[text] for text in call.texts]])
        self.batches += 1
        self.calls += len(batch)
