"""Micro-batching of embedding work: concurrent requests' sentences go through the model together.

Every compression that needs vectors for texts not in the cache hands them to one `EmbedBatcher`
thread. The thread takes the first waiting call, waits up to `window_ms` for more (requests that
arrived together usually ask within a few milliseconds of each other), encodes the union once
(texts asked twice are encoded once) and hands each caller its rows. One encode of 200 sentences
costs much less than four of 50 (fixed per-call overhead, better matmul shapes), and only this one
thread runs the embedding model, with its own small OpenMP budget (`threads`), so the embedder
never starts a second OpenMP team beside the engine's (backend/platform/openmp.py).

With the embedder on the in-process engine's thread there is no batching thread: `EngineJobBatcher`
lets the calls that wait for the engine at the same time share one forward pass there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ctxgate.compression.fair import charge_turn

logger = logging.getLogger(__name__)

Encode = Callable[[list[str]], np.ndarray]


@dataclass
class EngineTime:
    """Seconds the in-process engine's thread spent on one compression's embedding passes. While a
    pass runs there, every request in the engine waits: on a two-core machine this, not the
    compression's wall time, is what a burst of cold requests costs the requests already running.
    `embedding_seconds`: the compression's own wait for its vectors, wherever the model ran (loading
    it included), so the first request's model load is not mistaken for a stage's work."""

    seconds: float = 0.0
    embedding_seconds: float = 0.0


# The compression being run in this context (set by CompressionPipeline.run_here), if any.
ENGINE_TIME: ContextVar[EngineTime | None] = ContextVar("embedding_engine_time", default=None)


def charge_engine_time(seconds: float) -> None:
    """Add `seconds` of the engine thread's time to the compression running in this context, and
    to its tenant's share of the CPU (compression/fair.py)."""
    engine_time = ENGINE_TIME.get()
    if engine_time is not None:
        engine_time.seconds += seconds
    charge_turn(seconds)


def charge_embedding_time(seconds: float) -> None:
    """Add `seconds` of waiting for embeddings to the compression running in this context."""
    engine_time = ENGINE_TIME.get()
    if engine_time is not None:
        engine_time.embedding_seconds += seconds


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
        from ctxgate.backend.platform import openmp

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


@dataclass(eq=False)  # compared by identity: a call is one caller's, whatever its batch holds
class _PackedCall:
    batch: Any  # ctxgate.compression.embedding.packed_encoder.PackedBatch
    future: Future[np.ndarray] = field(default_factory=Future)
    # Its share of the pass that served it (by word pieces), set on the engine's thread before the result.
    engine_seconds: float = 0.0


class EngineJobBatcher:
    """Coalesces the packed-encoder calls that wait for the engine thread into one forward pass.

    With the embedder on the in-process engine (`AsyncEngine.run_between_steps`) every call is a job
    on the engine's thread. Requests that arrive together (a burst of cold requests) used to run their
    forward passes one after another, and each pass is ~150 torch ops whose every return re-takes the
    GIL from the other compression workers' Python, which can multiply a pass's time. Each call still queues its own job, but the first
    job to run takes every call waiting by then (up to `max_tokens` word pieces) and runs them as one
    pass: one set of ops for the burst, with all of its callers blocked (not holding the GIL)
    meanwhile; a later job that finds its call taken returns at once. No window is waited for: the
    time until the engine's next layer boundary is the window.
    """

    def __init__(
        self,
        runner: Callable[[Callable[[], None]], Future],
        encode_packed: Callable[[Any], np.ndarray],
        max_tokens: int,
    ):
        self._runner = runner
        self._encode_packed = encode_packed
        self.max_tokens = max_tokens
        self._pending: list[_PackedCall] = []
        self._lock = threading.Lock()
        # Observability (and the tests): how many forward passes served how many calls.
        self.batches = 0
        self.calls = 0

    def encode(self, batch: Any) -> np.ndarray:
        """Mean-pooled rows for `batch` (a PackedBatch); raises what the runner raised (EngineError
        once the engine is gone) or what the forward pass raised."""
        call = _PackedCall(batch)
        with self._lock:
            self._pending.append(call)
        try:
            job = self._runner(lambda: self._run_pending(call))
        except BaseException as exc:
            self._withdraw(call, exc)
        else:
            job.add_done_callback(lambda done: self._on_job_done(call, done))
        vectors = call.future.result()
        charge_engine_time(call.engine_seconds)
        return vectors

    def _on_job_done(self, call: _PackedCall, job: Future) -> None:
        error = job.exception() if not job.cancelled() else RuntimeError("the embedding job was cancelled")
        if error is not None:  # the job never ran (the engine stopped): its call may still be waiting
            self._withdraw(call, error)

    def _withdraw(self, call: _PackedCall, error: BaseException) -> None:
        with self._lock:
            if call not in self._pending:
                return  # another job took it and answers it
            self._pending.remove(call)
        call.future.set_exception(error)

    def _take(self, own: _PackedCall) -> list[_PackedCall]:
        """The job's own call (unless another job took it) and the others waiting, oldest first, up
        to `max_tokens` word pieces. The own call comes first so that a job run inline (asked from
        the engine's thread itself) always answers the call that is waiting on it."""
        with self._lock:
            waiting = ([own] if own in self._pending else []) + [
                call for call in self._pending if call is not own
            ]
            taken: list[_PackedCall] = []
            tokens = 0
            for call in waiting:
                call_tokens = sum(call.batch.lengths)
                if taken and tokens + call_tokens > self.max_tokens:
                    break
                taken.append(call)
                tokens += call_tokens
            self._pending = [call for call in self._pending if call not in taken]
        return taken

    def _run_pending(self, own: _PackedCall) -> None:
        """On the engine thread: one forward pass over the calls waiting now."""
        calls = self._take(own)
        if not calls:
            return
        started = time.perf_counter()
        try:
            vectors = self._encode_packed(merge_packed([call.batch for call in calls]))
        except BaseException as exc:  # every caller must be woken, with the error
            for call in calls:
                call.future.set_exception(exc)
            return
        seconds = time.perf_counter() - started
        self.batches += 1
        self.calls += len(calls)
        total_tokens = sum(sum(call.batch.lengths) for call in calls) or 1
        first_row = 0
        for call in calls:
            call.engine_seconds = seconds * sum(call.batch.lengths) / total_tokens
            rows = len(call.batch.lengths)
            call.future.set_result(vectors[first_row : first_row + rows])
            first_row += rows


def merge_packed(batches: list[Any]) -> Any:
    """Several PackedBatches as one: the tokens end to end, the sentences in order."""
    if len(batches) == 1:
        return batches[0]
    import torch

    from ctxgate.compression.embedding.packed_encoder import PackedBatch

    return PackedBatch(
        torch.cat([batch.input_ids for batch in batches]),
        torch.cat([batch.position_ids for batch in batches]),
        [length for batch in batches for length in batch.lengths],
    )
