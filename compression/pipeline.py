"""The compression pipeline the gateway calls.

    pipeline = CompressionPipeline(tokenizer, engine=None, cache=None, index_dir=None)
    result = await pipeline.run(CompressionInput(...), policy)

Guarantee: `result.prompt_tokens == tokenizer.count_chat(result.messages) <= policy.max_input_tokens`,
with every system message and the question verbatim; when those alone do not fit,
`BudgetExceededError` is raised instead. The algorithm is the ordered list `ctxgate.compression.stages.STAGES`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ctxgate.compression.context_lifting import report_kept
from ctxgate.compression.counting import CachedCounter, ChatTokenizer
from ctxgate.compression.embedding.batching import ENGINE_TIME, EngineTime
from ctxgate.compression.fair import FairScheduler, Pacer, yield_turn
from ctxgate.compression.history import SummaryEngine
from ctxgate.compression.rendering import render_context
from ctxgate.compression.segments import segment_tokens
from ctxgate.compression.services import PrefillCostEstimator, Services
from ctxgate.compression.stages import STAGES
from ctxgate.compression.stages.base import Stage, StageContext, run_timed
from ctxgate.compression.stages.conversation import remember
from ctxgate.compression.state import PipelineState, RenderedPrompt, split_messages
from ctxgate.compression.store.cache import BytesCache, LRUBytesCache
from ctxgate.compression.types import CompressionInput, CompressionResult, Document, StageReport
from ctxgate.policies.schema import Policy

if TYPE_CHECKING:
    from ctxgate.backend.engine.api import GenerationDelta, GenerationRequest
    from ctxgate.compression.embedding.embeddings import Runner

__all__ = ["CompressionPipeline", "PrefillCostEstimator"]

logger = logging.getLogger(__name__)

Result = TypeVar("Result")


class CompressionPipeline:
    def __init__(
        self,
        tokenizer: ChatTokenizer,
        engine: SummaryEngine | None = None,
        cache: BytesCache | None = None,
        index_dir: str | Path | None = None,
        cost_estimator: PrefillCostEstimator | None = None,
        stages: tuple[Stage, ...] = STAGES,
        workers: int = 0,
        embed_batch_window_ms: float | None = None,
        embed_threads: int = 1,
        embed_process: bool = False,
        embed_runner: Runner | None = None,
        worker_nice: int = 0,
        pacer: Pacer | None = None,
    ):
        """`workers` > 0: compressing runs in that many threads of its own, off the caller's event
        loop (the loop keeps streaming other requests' tokens meanwhile); requests whose policy
        disables compression never queue behind them. `embed_batch_window_ms`: concurrent requests'
        embeddings are coalesced by one batching thread with `embed_threads` OpenMP threads.
        `embed_process`: the embedding model runs in a child process, off this process's GIL
        (compression/embedding/embed_process.py), which an engine thread in this process needs.
        `embed_runner`: the model's forward passes run through it instead (the in-process CPU
        engine's `run_between_steps`), which takes precedence over `embed_process`. `worker_nice`: the
        workers run that much below the calling process's CPU priority (Linux), so that their Python
        yields the cores to an engine thread in this process (GatewaySettings.compression_nice).
        `pacer`: the workers charge each tenant's CPU to it and pause a tenant over its share at their
        yield points (compression/fair.py)."""
        self.tokenizer = tokenizer
        self.counter = CachedCounter(tokenizer)
        self.cache = cache if cache is not None else LRUBytesCache()
        self.cost_estimator = cost_estimator or PrefillCostEstimator()
        self.services = Services(self.counter, tokenizer, engine, self.cache, index_dir, self.cost_estimator)
        self.stages = stages
        if embed_batch_window_ms is not None:
            self.services.embed_batching = (embed_batch_window_ms, embed_threads)
        self.services.embed_process = embed_process
        self.services.embed_runner = embed_runner
        self._worker = _WorkerState()
        # Tenants take turns at the workers (compression/fair.py): one tenant's huge document
        # does not hold another's small request behind it.
        self._executor = (
            FairScheduler(
                workers,
                initializer=lambda: _init_worker(worker_nice),
                on_thread_exit=self._close_worker_loop,
                pacer=pacer,
            )
            if workers > 0
            else None
        )
        self._caller_loop: asyncio.AbstractEventLoop | None = None

    @property
    def engine(self) -> SummaryEngine | None:
        return self.services.engine

    @engine.setter
    def engine(self, engine: SummaryEngine | None) -> None:
        self.services.engine = engine
        self.services.summarizer.engine = engine

    async def run(
        self,
        request: CompressionInput,
        policy: Policy,
        prepare: Callable[[CompressionInput], CompressionInput] | None = None,
        counter: CachedCounter | None = None,
        tenant: str | None = None,
    ) -> CompressionResult:
        """`tenant`: whose turn this work takes at the compression workers (default: the request's
        `tenant`); tenants are served round-robin, so one's large documents do not queue another's.
        `prepare`: work on the request's text to do first (the gateway's neutraliser), in the
        compression worker, or in a thread of its own when none is used: never on this event loop.
        `counter`: the tokens of the model this request is for, when it is not the pipeline's
        tokenizer's (a gateway serving several models); the guarantee then holds in its counts."""
        if self._executor is None or not policy.compression_enabled:
            # Nothing to compress (counting only): no reason to wait for a compression worker.
            if prepare is not None:
                request = await asyncio.to_thread(prepare, request)
            return await self.run_here(request, policy, counter)
        if self._caller_loop is None:
            self._caller_loop = asyncio.get_running_loop()
            if self.services.engine is not None:
                self.engine = LoopBridge(self.services.engine, self._caller_loop)
        future = self._executor.submit(
            tenant or request.tenant,
            self._run_in_worker,
            request,
            policy,
            time.perf_counter(),
            prepare,
            counter,
        )
        return await asyncio.wrap_future(future)

    def warm_up(self, stopping: threading.Event) -> int:
        """Load the embedding model and run it once per shape real calls will meet (Embedder.warm_up),
        and build the dedup normaliser's tables, so the first requests pay for neither."""
        from ctxgate.compression.text import normalize_for_dedup

        if stopping.is_set():
            return 0
        calls = self.services.embedder.warm_up(stopping)  # the property loads the model
        normalize_for_dedup("\u00e9")  # builds its combining-marks table before a request does
        return calls

    def observe_prefill(self, prompt_tokens: int, prefill_ms: float) -> None:
        self.cost_estimator.observe_prefill(prompt_tokens, prefill_ms)

    def forget_text_caches(self) -> None:
        """Forget what was computed per text (embeddings, sentence splits, token counts): the next
        request is compressed as if its passages were new (how an evaluation times first sight)."""
        self.services.embedder.forget()
        self.services.splitter.forget()
        self.counter.forget()

    def close(self) -> None:
        self.services.release()
        if self._executor is not None:
            self._executor.shutdown(cancel_futures=True)

    def _close_worker_loop(self) -> None:
        loop, self._worker.loop = self._worker.loop, None
        if loop is not None:
            loop.close()

    def _run_in_worker(
        self,
        request: CompressionInput,
        policy: Policy,
        submitted: float,
        prepare: Callable[[CompressionInput], CompressionInput] | None = None,
        counter: CachedCounter | None = None,
    ) -> CompressionResult:
        wait_ms = (time.perf_counter() - submitted) * 1000
        if prepare is not None:
            request = prepare(request)
        loop = self._worker.loop
        if loop is None:
            loop = self._worker.loop = asyncio.new_event_loop()
        result = loop.run_until_complete(self.run_here(request, policy, counter))
        result.wait_ms = wait_ms
        return result

    async def run_here(
        self, request: CompressionInput, policy: Policy, counter: CachedCounter | None = None
    ) -> CompressionResult:
        """The stages, in the calling thread and event loop."""
        started = time.perf_counter()
        counter = counter or self.counter
        state = split_messages(request, budget_tokens=policy.max_input_tokens)
        ctx = StageContext(policy=policy, counter=counter, services=self.services)
        reports: list[StageReport] = []
        engine_time = EngineTime()
        token = ENGINE_TIME.set(engine_time)
        try:
            for stage in self.stages:
                if stage.enabled(state, policy):
                    embedded_before = engine_time.embedding_seconds
                    report = await run_timed(stage, state, ctx)
                    # Embedding is reported on its own: the first request's model load is not dedup's work.
                    report.ms = max(0.0, report.ms - (engine_time.embedding_seconds - embedded_before) * 1000)
                    reports.append(report)
                yield_turn()
        finally:
            ENGINE_TIME.reset(token)
        if state.carried is not None:
            remember(state, ctx)  # what the fit let through is what the next turn sends again
        if state.compressing:
            self.cost_estimator.observe_compression((time.perf_counter() - started) * 1000)
        report_kept(state, reports, counter)
        result = result_of(state, reports, policy, counter)
        result.engine_ms = engine_time.seconds * 1000
        result.embedding_ms = engine_time.embedding_seconds * 1000
        result.prefill_ms_per_token = self.cost_estimator.ms_per_token
        return result


class _WorkerState(threading.local):
    """Per compression worker thread: its own event loop, made on the thread's first request."""

    loop: asyncio.AbstractEventLoop | None = None


def _init_worker(nice: int) -> None:
    """A compression worker runs torch ops (if any) inline, with no OpenMP team beside the engine's,
    and at `nice` below the process's CPU priority."""
    from ctxgate.backend.platform import openmp

    openmp.limit_calling_thread(1)
    lower_thread_priority(nice)


def lower_thread_priority(nice: int) -> bool:
    """Lower the calling thread's CPU priority by `nice` steps (at most to 19); False where that
    cannot be done for one thread. On Linux a thread is a task of its own and setpriority on its id
    changes that thread only; elsewhere it would renice the whole process, so nothing is done."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    thread_id = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread_id)
        os.setpriority(os.PRIO_PROCESS, thread_id, min(19, current + nice))
    except OSError as exc:
        logger.warning("could not lower the compression worker's CPU priority: %s", exc)
        return False
    return True


class LoopBridge:
    """The engine as a compression worker sees it (a `SummaryEngine`): its calls run on the
    gateway's event loop (an HTTP upstream's connection pool belongs to that loop), their results
    are handed back to the worker's."""

    def __init__(self, engine: SummaryEngine, loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self._loop = loop

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    def is_ready(self) -> bool:
        return self._engine.is_ready()

    async def _on_loop(self, coroutine: Coroutine[Any, Any, Result]) -> Result:
        if asyncio.get_running_loop() is self._loop:
            return await coroutine
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        async def collect() -> list[GenerationDelta]:
            return [delta async for delta in self._engine.generate(request)]

        # Summaries are short and read whole: collecting them first keeps the bridge simple.
        for delta in await self._on_loop(collect()):
            yield delta

    async def abort(self, request_id: str) -> None:
        await self._on_loop(self._engine.abort(request_id))


def result_of(
    state: PipelineState, reports: list[StageReport], policy: Policy, counter: CachedCounter
) -> CompressionResult:
    assert state.original is not None and state.sent is not None, "the cost check and the fit always run"
    reconcile_savings(reports, state.original.tokens - state.sent.tokens)
    # The original prompt keeps every title; a compressed one keeps them as the policy says.
    keep_titles = policy.extraction.keep_titles if state.compressing else True
    original = prompt_segments(state.original, counter)
    passages = [p for p in state.passages if not p.is_empty()]
    return CompressionResult(
        messages=state.sent.messages,
        original_prompt_tokens=state.original.tokens,
        prompt_tokens=state.sent.tokens,
        stages=reports,
        kept_documents=[
            Document(text=p.body(), id=p.document.id, title=p.title, score=p.score) for p in passages
        ],
        context_text=render_context(passages, keep_titles),
        original_messages=state.original.messages,
        segments_original=original,
        segments_sent=dict(original)
        if state.sent is state.original
        else prompt_segments(state.sent, counter),
    )


def reconcile_savings(reports: list[StageReport], saved_exactly: int) -> None:
    """Stages estimate their savings from per-unit counts; the last report (the fit, the one exact
    count) takes the remainder, so the reports add up to exactly what was saved."""
    reports[-1].saved_tokens = saved_exactly - sum(report.saved_tokens for report in reports[:-1])


def prompt_segments(prompt: RenderedPrompt, counter: CachedCounter) -> dict[str, int]:
    """The prompt's tokens per segment, adding up to its exact count (empty: the prompt's messages
    were not described)."""
    if not prompt.layouts:
        return {}
    return segment_tokens(counter, prompt.messages, prompt.layouts, prompt.tokens)
