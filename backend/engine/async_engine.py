"""`AsyncEngine`: the in-process engine client — `LLMEngine` driven by one background thread.

`LLMEngine` is single-threaded and its `step()` blocks for a whole model forward pass, so it runs in
its own thread and never on the event loop. The asyncio side talks to it only through a thread-safe
command queue (add / abort / stop), applied between steps; deltas travel back to each request's
`asyncio.Queue` through `loop.call_soon_threadsafe`, batched once per step and loop. When nothing is
running the thread blocks on the command queue, so an idle engine costs no CPU.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ctxgate.backend.engine.api import (
    NO_GROUPS,
    EngineClient,
    EngineError,
    GenerationDelta,
    GenerationRequest,
)
from ctxgate.backend.engine.engine_commands import WAKE, Abort, Add, CommandQueue, Stop
from ctxgate.backend.engine.live_requests import LiveRequests, send
from ctxgate.backend.engine.metrics import EngineMetrics
from ctxgate.backend.engine.request_stream import RequestStream
from ctxgate.backend.engine.side_work import Job, SideWorkQueue

ENGINE_SWITCH_INTERVAL_S = 0.0005

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry

    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.engine.engine_stats import EngineStats
    from ctxgate.backend.engine.llm_engine import LLMEngine
    from ctxgate.backend.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class AsyncEngine:
    """`EngineClient` for the built-in engine, running `LLMEngine` in a background thread.

    Construct with an `EngineConfig` (this loads the model); `start()` launches the thread and is
    also called lazily by the first request. `max_waiting_requests` bounds the waiting queue:
    requests beyond it are refused with `EngineError(..., 503)`.
    """

    def __init__(
        self,
        config: EngineConfig,
        max_waiting_requests: int | None = None,
        engine: LLMEngine | None = None,
    ):
        if engine is None:
            from ctxgate.backend.engine.llm_engine import LLMEngine

            engine = LLMEngine(config)
        self.config = config
        self.engine = engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.metrics = EngineMetrics(self.model_name)
        # Which compute path serves (CPU kernels, dtype, matmul dispatch): fixed for the process.
        self.path_info: dict[str, object] = engine.path_info()
        self.metrics.set_path_info(self.path_info)
        self._commands = CommandQueue()
        self._side_work = SideWorkQueue()  # run_between_steps jobs
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stopped = False
        self._fatal_error: BaseException | None = None
        self._live = LiveRequests(engine, self.metrics, max_waiting_requests)  # owned by the engine thread
        self._stats: EngineStats = engine.stats()
        self.metrics.update_from_stats(self._stats)

    @classmethod
    def from_config(cls, max_waiting_requests: int | None = None, **config_fields: Any) -> AsyncEngine:
        """Build from `EngineConfig` field values, e.g. `AsyncEngine.from_config(model=path)`."""
        from ctxgate.backend.engine.config import EngineConfig

        return cls(EngineConfig(**config_fields), max_waiting_requests=max_waiting_requests)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._start_lock:
            if self._thread is not None:
                return
            if self._stopped:
                raise EngineError("the engine has been shut down", 503)
            self._thread = threading.Thread(target=self._run, name="ctxgate-engine", daemon=True)
            # The engine thread gets the cores: the caller (model loading, event loop) keeps no
            # OpenMP team that would make libgomp throttle the engine's (backend/platform/openmp.py).
            from ctxgate.backend.platform import openmp

            openmp.hand_cores_to_engine()
            # The engine thread re-takes the GIL between every op of a forward pass; while another
            # thread runs Python (the event loop, compression) each re-take waits up to a whole
            # switch interval, so the process runs at the engine's shorter one
            # (docs/decisions/engine-switch-interval.md).
            sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; requests still running end with an EngineError (503)."""
        with self._start_lock:
            self._stopped = True
            thread = self._thread
            if thread is not None:
                self._commands.put(Stop())
        if thread is not None:
            thread.join(timeout)

    async def stop(self) -> None:
        """`shutdown` off the event loop (it joins the engine thread)."""
        await asyncio.to_thread(self.shutdown)

    def is_ready(self) -> bool:
        return (
            not self._stopped
            and self._fatal_error is None
            and (self._thread is None or self._thread.is_alive())
        )

    # In-process, `is_ready` is always current: there is nothing a probe could learn.
    needs_health_check = False

    async def check_health(self) -> bool:
        return self.is_ready()

    @property
    def metrics_registry(self) -> CollectorRegistry:
        return self.metrics.registry

    def stats(self) -> EngineStats:
        """The engine statistics as of the last step or command batch (never blocks on a step)."""
        return self._stats

    @property
    def num_threads(self) -> int:
        """The torch CPU threads the engine thread computes with."""
        return self.engine.num_threads

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype the model's weights were loaded in (after resolving "auto")."""
        return self.engine.dtype

    # ------------------------------------------------------------------ requests
    async def add_request(self, request: GenerationRequest) -> RequestStream:
        """Submit a request and wait until the engine accepted it.

        Raises the `EngineError` the engine refused it with, so a server can answer with an HTTP
        error before it starts streaming.
        """
        stream = self._open(request)
        try:
            await asyncio.shield(stream.accepted)
        except asyncio.CancelledError:
            stream.close()
            raise
        except EngineError:
            stream.finished = True
            raise
        return stream

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream deltas; stopping the iteration early aborts the request and frees its blocks."""
        stream = self._open(request)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its consumer receives a final delta with finish_reason "abort"."""
        self._submit(Abort(request_id, notify=True))

    @property
    def jobs_run(self) -> int:
        """run_between_steps jobs the engine thread ran (observability, tests)."""
        return self._side_work.jobs_run

    @property
    def forwards_fields(self) -> bool:
        return False

    @property
    def groups(self) -> Mapping[str, EngineClient]:
        return NO_GROUPS  # one model

    @property
    def side_work(self) -> AsyncEngine | None:
        """This engine as a side-work runner when it computes on the CPU (where sharing its thread
        and cores is what pays); None on a GPU."""
        return self if self.engine.device.type == "cpu" else None

    def run_between_steps(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn()` on the engine thread with the engine's CPU threads: before the next step, or,
        on a CPU, between two decoder layers of the step in progress (`LlamaModel.between_layers`),
        so it starts within one layer's time even during a long prefill step.

        For CPU work the gateway must do anyway (embedding the sentences of a first-sight
        compression): beside a running engine it would be a third busy thread on two cores, slowed
        by the engine and slowing it (OpenMP teams waiting on a descheduled member). Here it has the
        cores to itself and delays the engine by its own run time only; queued jobs run at the next
        such point, within side work's share of the thread's time while the engine has requests
        (backend/engine/side_work.py). Raises `EngineError` (503) once the engine is shut down; a job still queued
        then fails with it.
        """
        job = Job(fn)
        if threading.current_thread() is self._thread:  # asked from a job: waiting would deadlock
            job.run()
            return job.future
        self.start()
        # Under the lock that `shutdown` queues its stop under and the engine thread's last drain
        # takes: a job is either queued before them (and runs, or fails with the engine) or refused
        # here, never left unanswered.
        with self._start_lock:
            if self._stopped:
                raise EngineError("the engine has been shut down", 503)
            if self._fatal_error is not None or not self.is_ready():
                raise EngineError(f"the engine failed: {self._fatal_error}", 503)
            self._side_work.put(job)
            self._submit(WAKE)  # an idle engine thread sleeps on the command queue
        return job.future

    def _open(self, request: GenerationRequest) -> RequestStream:
        if self._stopped:
            raise EngineError("the engine has been shut down", 503)
        if self._fatal_error is not None:
            raise EngineError(f"the engine failed: {self._fatal_error}", 503)
        self.start()
        if request.arrival_time is None:
            # The engine thread takes new requests between steps; one submitted mid-step (a 512-token
            # prefill step takes ~0.4 s on 2 cores) waits for it, and that wait is queue time.
            request = replace(request, arrival_time=time.perf_counter())
        stream = RequestStream(
            request.request_id,
            asyncio.get_running_loop(),
            on_close=lambda: self._submit(Abort(request.request_id, notify=False)),
        )
        self._submit(Add(request, stream))
        return stream

    def _submit(self, command: Any) -> None:
        self._commands.put(command)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        import torch

        torch.set_num_threads(self.engine.num_threads)
        if self.side_work is not None:  # a CPU engine: see run_between_steps and _between_layers
            self.engine.model.between_layers = self._between_layers
        try:
            while True:
                # Idle: block until a command arrives instead of spinning.
                # (Side work deferred while the engine was busy runs now, not at the next command.)
                block = not self.engine.has_unfinished_requests() and not self._side_work.pending
                if not self._apply_commands(block=block):
                    break
                self._side_work.busy = self.engine.has_unfinished_requests()
                self._side_work.run_pending()
                if not self._side_work.busy:
                    continue
                side_before, started = self._side_work.spent_s, time.perf_counter()
                try:
                    deltas = self.engine.step()
                except Exception as exc:
                    # A request that makes the step raise is aborted alone inside `step`; what still
                    # escapes it (scheduling itself) is no one request's: the engine's state is
                    # suspect, so every request fails rather than hanging.
                    logger.exception("engine step failed outside any request")
                    self._fail_all(EngineError(f"engine step failed: {exc}", 500))
                    continue
                side_during = self._side_work.spent_s - side_before  # between its decoder layers
                self._side_work.earn(time.perf_counter() - started - side_during)
                self._live.dispatch(deltas)
                self._live.deliver_failures(self.engine.take_failures())
                self._refresh_stats()
                self.metrics.observe_step(self._stats.last_step_num_tokens)
        except BaseException as exc:
            logger.exception("engine thread died")
            self._fatal_error = exc
        finally:
            self._fail_all(EngineError("the engine has been shut down", 503))
            self._side_work.fail_pending(EngineError("the engine has been shut down", 503), self._start_lock)

    def _between_layers(self) -> None:
        """At each decoder-layer boundary of a step on a CPU: queued side work, then requests sent
        since the step began, and a nested prefill for the one whose turn it is
        (backend/engine/interleaved_prefill.py), its first token delivered at once."""
        self._side_work.run_pending()
        if not self.engine.interleaved.enabled:
            return
        for command in self._commands.adds_mid_step():
            self._live.add(command.request, command.stream)
        deltas = self.engine.prefill_between_layers()
        if deltas:
            self._live.dispatch(deltas)
        self._live.deliver_failures(self.engine.take_failures())

    def _apply_commands(self, block: bool) -> bool:
        """Apply every pending command; returns False when the thread must stop."""
        applied = False
        while True:
            try:
                command = self._commands.get(block=block and not applied)
            except queue.Empty:
                break
            applied = True
            if isinstance(command, Stop):
                return False
            if isinstance(command, Add):
                self._live.add(command.request, command.stream)
            elif isinstance(command, Abort):
                self._live.abort(command.request_id, command.notify)
        if applied:
            self._refresh_stats()
        return True

    def _fail_all(self, error: EngineError) -> None:
        self._live.fail_all(error)
        # Requests still queued as commands never reached the engine: refuse them too.
        while True:
            try:
                command = self._commands.get(block=False)
            except queue.Empty:
                break
            if isinstance(command, Add):
                send(command.stream, error)
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        stats = self.engine.stats()
        self._stats = stats
        self.metrics.update_from_stats(stats)
