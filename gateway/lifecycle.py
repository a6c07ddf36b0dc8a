"""The gateway's life: start the engine, poll policy and key files, load the embedder, shut down.

Shutdown order: stop the file watcher and the embedder load, close the quota store and the
pipeline, then the engine if the gateway owns it; a request still draining never loses its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI

from ctxgate.backend.engine.guided import compiler_for
from ctxgate.gateway.banner import log_banner
from ctxgate.gateway.service import Gateway

logger = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    gateway: Gateway = app.state.gateway
    gateway.engine.start()
    await gateway.engine.check_health()
    if not gateway.forwards_fields:  # the built-in engine: grammar workers start now, not per request
        try:
            await asyncio.to_thread(compiler_for(gateway.tokenizer).warm_up)
        except Exception:  # the first structured-output request retries (and reports) it
            logger.exception("starting the grammar workers failed")
    log_banner(gateway)
    watcher = asyncio.create_task(watch_files(gateway), name="ctxgate-reload")
    console = app.state.console
    sampler = (
        asyncio.create_task(console.sample_forever(), name="ctxgate-console-sampler")
        if console is not None
        else None
    )
    embedder_load = app.state.embedder_load = EmbedderLoad(gateway)
    embedder_load.start()
    try:
        yield
    finally:
        if sampler is not None:
            sampler.cancel()
        watcher.cancel()
        await gateway.shadow.close()  # before the engine stops: its shadow requests are aborted
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        # Before the engine stops: a warm-up call waiting on the engine's thread finishes there.
        await embedder_load.stop()
        await gateway.store.close()
        gateway.pipeline.close()
        if app.state.owns_engine:
            await gateway.engine.stop()


class EmbedderLoad:
    """Loads the embedding model (and starts its process) on a thread of its own at startup, and runs
    it once on each shape it will meet (`Embedder.warm_up`), so the first compressing requests pay for
    neither; a request that comes sooner waits for the same load, not for the warm-up. `/ready` answers
    503 until it is done, so a load balancer sends no traffic to a gateway still loading it.

    Not asyncio.to_thread: shutdown must not wait for the whole load (on a busy 2-core machine
    loading the model and starting its process can outlast a supervisor's stop timeout), so `stop`
    ends the warm-up between two calls and waits two seconds at most. A daemon thread still inside
    torch when the interpreter finalizes aborts the process ("terminate called without an active
    exception", exit -6 after a clean drain), so `ctxgate serve` skips finalization while the thread
    runs (`exit_if_still_loading`).
    """

    STOP_TIMEOUT_S = 2.0
    RETRY_S = 10.0

    def __init__(self, gateway: Gateway):
        self.pipeline = gateway.pipeline
        self.stopping = threading.Event()
        self.loaded = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(
            target=self._load_until_loaded, name="ctxgate-embedder-load", daemon=True
        )
        self.thread.start()

    def is_loaded(self) -> bool:
        """The model is loaded (its process started) and warmed up: what /ready waits for."""
        return self.loaded.is_set()

    def _load_until_loaded(self) -> None:
        # /ready waits for the load, so a failed one (a child process that did not start in time on a
        # busy machine) is tried again rather than leaving the gateway out of rotation for good.
        while not self.stopping.is_set():
            try:
                self._load()
            except Exception:
                logger.exception("loading the embedding model failed; trying again in %g s", self.RETRY_S)
                self.stopping.wait(self.RETRY_S)
            else:
                self.loaded.set()
                return

    def _load(self) -> None:
        from ctxgate.backend.platform import openmp

        if self.stopping.is_set():
            return
        openmp.limit_calling_thread(1)  # no OpenMP team beside the engine's (backend/platform/openmp.py)
        started = time.perf_counter()
        calls = self.pipeline.warm_up(self.stopping)
        logger.info(
            "embedding model loaded and warmed up (%d calls) in %.1f s", calls, time.perf_counter() - started
        )

    async def stop(self) -> None:
        """End the warm-up after its current call and wait a little for the thread."""
        self.stopping.set()
        thread = self.thread
        if thread is not None and thread.is_alive():
            await asyncio.to_thread(thread.join, self.STOP_TIMEOUT_S)

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def exit_if_still_loading(app: FastAPI) -> None:
    """After a clean shutdown, end the process at once if the embedding model is still loading:
    interpreter finalization beside a thread in torch aborts (see `EmbedderLoad`). Everything the
    gateway owns is closed by then; the log is flushed first."""
    embedder_load: EmbedderLoad | None = app.state.embedder_load
    if embedder_load is None or not embedder_load.running():
        return
    logger.info("the embedding model is still loading; exiting without waiting for it")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


async def watch_files(gateway: Gateway) -> None:
    """Poll policies and keys so edits apply within a couple of intervals, no restart needed."""
    interval = gateway.settings.reload_interval_s
    ticks = 0
    while True:
        await asyncio.sleep(interval)
        ticks += 1
        try:
            if await asyncio.to_thread(gateway.policies.refresh):
                gateway.metrics.policies_loaded.set(len(gateway.policies.names()))
            await asyncio.to_thread(gateway.keys.refresh)
            if gateway.engine.needs_health_check and ticks % 3 == 0:
                await gateway.engine.check_health()
        except Exception:  # the watcher must survive anything a file can do to it
            logger.exception("policy/keys reload failed")
