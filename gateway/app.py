"""The FastAPI application: OpenAI-compatible routes on top of `gateway.service.Gateway`.

`create_app(settings, engine=None, pipeline=None)` builds everything; tests and the eval harness run
it in-process. Without an engine it starts the in-process engine, or the HTTP upstream client when
`settings.upstreams` is set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from importlib.metadata import version as package_version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from backend.api import EngineClient, GenerationRequest
from backend.openai_api.errors import APIError, ClientDisconnected, install_error_handlers
from backend.openai_api.http import (
    BodySizeLimit,
    document_request_bodies,
    parse_body,
    parse_body_and_json,
    unless_disconnected,
)
from backend.openai_api.responses import ResponseWriter, Usage, fold_chunks
from backend.openai_api.sse import DONE, event_stream_response, sse_event
from gateway.admission import AdmissionCollector, AdmissionControl, AdmissionController
from gateway.keys import KeyStore, Tenant
from gateway.metrics import GatewayMetrics
from gateway.quota import Clock, create_store
from gateway.request_id import RequestId
from gateway.schemas import ChatCompletionRequest, CompletionRequest, GatewayRequest
from gateway.service import Gateway, Outcome, Pipeline, Prepared
from gateway.settings import GatewaySettings
from policies.loader import PolicyRegistry, ReloadError, packaged_policy_dir

logger = logging.getLogger(__name__)

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/ctxgate/compress": ChatCompletionRequest,
}
ERROR_ANSWERS = {
    "400": "invalid request (OpenAI-style error object)",
    "401": "missing or invalid API key",
    "413": "body or prompt too large for the limit or policy budget",
    "429": "over quota; see Retry-After",
    "503": "overloaded or draining (error code 'overloaded'); see Retry-After",
}


# -- construction --------------------------------------------------------------------------------
def _default_engine(settings: GatewaySettings) -> EngineClient:
    if settings.upstreams:
        from backend.upstream import UpstreamClient, UpstreamConfig

        config = UpstreamConfig(
            urls=list(settings.upstreams), model=settings.upstream_model,
            connect_timeout_s=settings.upstream_connect_timeout_s,
            read_timeout_s=settings.upstream_read_timeout_s, retries=settings.upstream_retries,
            api_key=settings.upstream_api_key,
        )
        return UpstreamClient(config, served_model_name=settings.served_model_name or settings.upstream_model)
    from backend.async_engine import AsyncEngine  # noqa: I001 (lands with the engine branch)
    from backend.config import EngineConfig
    from backend.model_prepare import prepare_default_model

    return AsyncEngine(EngineConfig(model=str(settings.model or prepare_default_model())),
                       max_waiting_requests=settings.engine_max_waiting_requests)


def _tokenizer_for(settings: GatewaySettings, engine: EngineClient) -> Any:
    if settings.tokenizer:  # counting for a remote model: no local model package needed
        from gateway.tokenizers import load_counting_tokenizer

        return load_counting_tokenizer(settings.tokenizer)
    if engine.tokenizer is not None:
        return engine.tokenizer
    from backend.model_prepare import prepare_default_model
    from backend.tokenizer import load_tokenizer

    return load_tokenizer(str(settings.model or prepare_default_model()))


def default_pipeline(
    tokenizer: Any, engine: EngineClient, index_dir: Any = None, settings: GatewaySettings | None = None
) -> Pipeline:
    """The compression pipeline over this engine, with its own thread budget (see GatewaySettings)."""
    from compression.pipeline import CompressionPipeline

    settings = settings or GatewaySettings()
    cache = None
    if settings.embed_cache_url:
        from compression.redis_cache import RedisBytesCache

        cache = RedisBytesCache(settings.embed_cache_url)
    side_work = engine.side_work if settings.embed_on == "engine" else None
    runner = side_work.run_between_steps if side_work is not None else None
    # The engine serves history summaries at background priority; an HTTP upstream is used the same way.
    return CompressionPipeline(
        tokenizer, engine=engine, index_dir=index_dir, cache=cache, workers=settings.compression_workers,
        worker_nice=settings.compression_nice,
        embed_batch_window_ms=settings.embed_batch_window_ms, embed_threads=settings.embed_threads,
        embed_process=runner is None, embed_runner=runner,
    )


def _policy_registry(settings: GatewaySettings, metrics: GatewayMetrics) -> PolicyRegistry:
    directories = []
    if settings.include_packaged_policies:
        directories.append(packaged_policy_dir())
    if settings.policy_dir is not None and (
        not directories or settings.policy_dir.resolve() != directories[0].resolve()
    ):
        directories.append(settings.policy_dir)

    def on_failure(error: ReloadError) -> None:
        metrics.policy_reload_failures.labels(error.path).inc()
        metrics.policy_reload_error.labels(error.path).set(1)

    def on_reload(loaded) -> None:
        metrics.policy_reload_error.labels(loaded.path).set(0)

    registry = PolicyRegistry(directories, on_reload_failure=on_failure, on_reload=on_reload)
    metrics.policies_loaded.set(len(registry.names()))
    return registry


_COUNTED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/ctxgate/compress", "/v1/ctxgate/policies",
})


class RequestCounter:
    """Counts responses by endpoint and status (pure ASGI: does not wrap streaming bodies)."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        # Only known routes become label values: arbitrary paths must not grow the metric.
        endpoint = path if path in _COUNTED_PATHS else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        return await self.app(scope, receive, counting_send)


def create_app(
    settings: GatewaySettings,
    engine: EngineClient | None = None,
    pipeline: Pipeline | None = None,
    clock: Clock = time.time,
) -> FastAPI:
    """The gateway app. `clock` decides every quota window (and so Retry-After); tests pass their own."""
    metrics = GatewayMetrics()
    owns_engine = engine is None
    engine = engine if engine is not None else _default_engine(settings)
    tokenizer = _tokenizer_for(settings, engine)
    pipeline = pipeline if pipeline is not None else default_pipeline(tokenizer, engine, settings.index_dir, settings)
    gateway = Gateway(
        settings=settings, engine=engine, tokenizer=tokenizer, pipeline=pipeline,
        policies=_policy_registry(settings, metrics), keys=KeyStore(settings.keys_file),
        store=create_store(settings.redis_url, clock=clock), metrics=metrics,
    )
    app = FastAPI(title="ctxgate", version=package_version("ctxgate"), lifespan=_lifespan)
    app.state.gateway = gateway
    app.state.owns_engine = owns_engine
    install_error_handlers(app)
    _add_routes(app)
    document_request_bodies(app, REQUEST_BODIES, ERROR_ANSWERS)
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes,
                       read_timeout_s=settings.body_read_timeout_s)
    app.state.admission = AdmissionController(settings.max_in_flight, settings.max_queued, settings.queue_timeout_s)
    app.add_middleware(AdmissionControl, controller=app.state.admission)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(RequestId, access_log=settings.access_log)  # outermost: every answer carries the id
    metrics.registry.register(AdmissionCollector(app.state.admission))
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    gateway: Gateway = app.state.gateway
    gateway.engine.start()
    await gateway.engine.check_health()
    watcher = asyncio.create_task(_watch_files(gateway), name="ctxgate-reload")
    embedder_load = app.state.embedder_load = _EmbedderLoad(gateway)
    warm_up = asyncio.create_task(embedder_load.run(), name="ctxgate-embedder-load")
    try:
        yield
    finally:
        warm_up.cancel()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        # Before the engine stops: a warm-up call waiting on the engine's thread finishes there.
        await embedder_load.stop()
        await gateway.store.close()
        close_pipeline = getattr(gateway.pipeline, "close", None)
        if close_pipeline is not None:
            close_pipeline()
        if app.state.owns_engine:
            await gateway.engine.stop()


class _EmbedderLoad:
    """Loads the embedding model (and starts its process) on a thread of its own at startup, and runs
    it once on each shape it will meet (`Embedder.warm_up`), so the first compressing requests pay for
    neither; a request that comes sooner waits for the same load, not for the warm-up.

    Not asyncio.to_thread: shutdown must not wait for the whole load (on a busy 2-core machine
    loading the model and starting its process can outlast a supervisor's stop timeout), so `stop`
    ends the warm-up between two calls and waits two seconds at most. A daemon thread still inside
    torch when the interpreter finalizes aborts the process ("terminate called without an active
    exception", exit -6 after a clean drain), so `ctxgate serve` skips finalization while the thread
    runs (`exit_if_still_loading`).
    """

    STOP_TIMEOUT_S = 2.0

    def __init__(self, gateway: Gateway):
        self.services = getattr(gateway.pipeline, "services", None)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    async def run(self) -> None:
        if self.services is None:
            return
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            # Running from here on: cancelling the awaiting task at shutdown no longer cancels
            # `loaded`, so setting its result below cannot fail.
            loaded.set_running_or_notify_cancel()
            try:
                self._load()
            except Exception as exc:  # the first request that needs it will report the error too
                loaded.set_exception(exc)
            else:
                loaded.set_result(None)

        self.thread = threading.Thread(target=run, name="ctxgate-embedder-load", daemon=True)
        self.thread.start()
        try:
            await asyncio.wrap_future(loaded)
        except Exception:
            logger.exception("loading the embedding model failed")

    def _load(self) -> None:
        from backend import openmp
        from compression.text import normalize_for_dedup

        if self.stopping.is_set():
            return
        openmp.limit_calling_thread(1)  # no OpenMP team beside the engine's (backend/openmp.py)
        started = time.perf_counter()
        calls = self.services.embedder.warm_up(self.stopping)  # the property loads the model
        normalize_for_dedup("\u00e9")  # builds its combining-marks table (~0.15 s) before a request does
        logger.info("embedding model loaded and warmed up (%d calls) in %.1f s", calls, time.perf_counter() - started)

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
    interpreter finalization beside a thread in torch aborts (see `_EmbedderLoad`). Everything the
    gateway owns is closed by then; the log is flushed first."""
    embedder_load = getattr(app.state, "embedder_load", None)
    if embedder_load is None or not embedder_load.running():
        return
    logger.info("the embedding model is still loading; exiting without waiting for it")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


async def _watch_files(gateway: Gateway) -> None:
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


# -- routes --------------------------------------------------------------------------------------
def _add_routes(app: FastAPI) -> None:
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_api_route("/metrics", prometheus_metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/ctxgate/policies", policies, methods=["GET"])
    app.add_api_route("/v1/ctxgate/compress", compress, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _tenant(request: Request) -> Tenant:
    return _gateway(request).authenticate(request.headers.get("authorization"), request.headers.get("x-api-key"))


async def health() -> dict[str, str]:
    return {"status": "ok"}


async def ready(request: Request) -> JSONResponse:
    gateway = _gateway(request)
    engine_ready = gateway.engine.is_ready() and not request.app.state.admission.draining
    store_ready = await gateway.store.ping()
    gateway.metrics.quota_store_up.set(1 if store_ready else 0)
    body = {"status": "ready" if engine_ready and store_ready else "not ready",
            "engine": engine_ready, "store": store_ready, "store_kind": gateway.store.name}
    return JSONResponse(body, status_code=200 if engine_ready and store_ready else 503)


async def prometheus_metrics(request: Request) -> Response:
    gateway = _gateway(request)
    _check_metrics_key(gateway.settings.metrics_key, request.headers.get("authorization"))
    payload = generate_latest(gateway.metrics.registry)
    engine_registry = gateway.engine.metrics_registry
    if engine_registry is not None:
        payload += generate_latest(engine_registry)
    return Response(payload, media_type=CONTENT_TYPE_LATEST)


def _check_metrics_key(expected: str | None, authorization: str | None) -> None:
    """With a metrics key set, /metrics (tenant names, spend, upstream health) needs it as a Bearer
    token; compared in constant time."""
    if expected is None:
        return
    given = (authorization or "").encode()
    if not hmac.compare_digest(given, f"Bearer {expected}".encode()):
        message = "/metrics needs the metrics key (Authorization: Bearer <key>)"
        raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def models(request: Request) -> dict[str, Any]:
    tenant = _tenant(request)
    gateway = _gateway(request)
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "ctxgate",
         "max_model_len": gateway.engine.max_model_len, "engine_path": gateway.engine.path_info}
        for name in gateway.allowed_models(tenant)
    ]}


async def policies(request: Request) -> dict[str, Any]:
    """The policies the caller may name, as they apply. A key sees only its own (no reload errors:
    those are about files, the operator's business); open mode lists every policy and error. File
    names only, never the server's directories."""
    tenant = _tenant(request)
    gateway = _gateway(request)
    allowed = gateway.allowed_policies(tenant)
    listed = [item for item in gateway.policies.loaded() if allowed is None or item.policy.name in allowed]
    body: dict[str, Any] = {
        "default": gateway.home_policy_name(tenant),
        "policies": [
            {"name": item.policy.name, "loaded_at": item.loaded_at,
             "effective": gateway.fit_to_model(item.policy).model_dump(mode="json")}
            | ({} if tenant.bounded else {"file": os.path.basename(item.path)})
            for item in listed
        ],
    }
    if not tenant.bounded:
        errors = [_reload_error(err, gateway.policies.directories) for err in gateway.policies.errors()]
        body |= {"errors": errors, "last_reload_error": errors[-1] if errors else None}
    return body


def _reload_error(error: ReloadError, directories: list[Any]) -> dict[str, Any]:
    # The loader's messages name files by their full paths: show file names instead.
    message = error.message
    for directory in directories:
        message = message.replace(f"{directory}{os.sep}", "")
    return {"file": os.path.basename(error.path), "message": message, "at": error.at}


async def compress(request: Request) -> dict[str, Any]:
    tenant = _tenant(request)
    gateway = _gateway(request)
    body = await parse_body(request, ChatCompletionRequest)
    gateway.check_model(body.model, tenant)
    policy = gateway.resolve_policy(tenant, body.ctxgate)
    result = await gateway.compress(body, tenant, policy)
    gateway.encode_checked(result, policy)
    # Compression is metered like a request that generates nothing: one request, its prompt tokens.
    await gateway.reserve(tenant, policy, result.prompt_tokens, 0)
    return {
        "messages": result.messages,
        "policy": policy.name,
        "report": {
            "original_prompt_tokens": result.original_prompt_tokens,
            "prompt_tokens": result.prompt_tokens,
            "saved_tokens": result.saved_tokens,
            "compression_ms": result.compression_ms,
            "compression_wait_ms": round(result.wait_ms, 3),
            "compression_engine_ms": round(result.engine_ms, 3),
            "message_context": result.message_context,
            "stages": [{"name": s.name, "saved_tokens": s.saved_tokens, "ms": round(s.ms, 3),
                        "details": s.details} for s in result.stages],
        },
    }


async def chat_completions(request: Request) -> Response:
    tenant = _tenant(request)
    body, raw = await parse_body_and_json(request, ChatCompletionRequest)
    prepared = await _gateway(request).prepare_chat(body, tenant, raw)
    return await _answer(request, body, prepared, messages=prepared.result.messages)


async def completions(request: Request) -> Response:
    tenant = _tenant(request)
    body, raw = await parse_body_and_json(request, CompletionRequest)
    prepared = await _gateway(request).prepare_completion(body, tenant, raw)
    return await _answer(request, body, prepared, messages=None)


async def _answer(
    request: Request, body: GatewayRequest, prepared: Prepared, messages: list[dict[str, Any]] | None
) -> Response:
    """Run the prepared request on the engine and answer whole or streamed, as the client asked."""
    gateway = _gateway(request)
    generation = GenerationRequest(
        request_id=prepared.request_id, prompt_token_ids=prepared.prompt_token_ids,
        sampling=prepared.sampling, priority=prepared.priority,
        cache_salt=gateway.cache_salt(prepared.tenant.name),
        messages=messages, prompt_text=prepared.prompt_text, forward=prepared.forward,
    )
    writer = ResponseWriter(prepared.request_id, body.model, prepared.created,
                            chat=isinstance(body, ChatCompletionRequest))
    run = _Run(gateway, prepared, generation)
    if body.stream:
        return await _stream(run, writer, request.url.path, body.usage_wanted())
    return await _complete(request, run, writer)


# -- generation ----------------------------------------------------------------------------------
class _Run:
    """Consumes the engine's deltas for one request and keeps what usage needs."""

    def __init__(self, gateway: Gateway, prepared: Prepared, generation: GenerationRequest):
        self.gateway = gateway
        self.prepared = prepared
        self.generation = generation
        self.outcome = Outcome(prompt_tokens=0)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished = False
        # Upstream mode: the upstream's chunks, relayed as they are (and folded when not streamed).
        self.relayed = generation.forward is not None
        self.chunks: list[dict[str, Any]] = []
        self.upstream_usage: dict[str, Any] | None = None
        self.upstream_id: str | None = None
        self._iterator: Any = None
        self._first: Any = None

    async def start(self) -> None:
        """Open the engine stream and wait for its first delta, so a refusal becomes an HTTP status."""
        self._iterator = _bounded(self.gateway.engine.generate(self.generation),
                                  self.gateway.settings.request_timeout_s, self.prepared.received_at)
        try:
            self._first = await self._iterator.__anext__()
        except StopAsyncIteration:
            self._first = None
        except BaseException:
            await self._stop_engine()
            raise

    async def _stop_engine(self) -> None:
        # The client went away or the backend failed: stop the work upstream.
        with contextlib.suppress(Exception):
            await self._iterator.aclose()
        with contextlib.suppress(Exception):
            await self.gateway.engine.abort(self.generation.request_id)

    def _take(self, delta) -> str:
        if delta.raw is not None:
            self.chunks.append(delta.raw)
            self.upstream_id = self.upstream_id or delta.raw.get("id")
        if delta.text:
            now = time.perf_counter()
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
            self.outcome.text += delta.text
        self.outcome.completion_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finished = True
            self.outcome.finish_reason = "length" if delta.finish_reason == "length" else "stop"
            self.outcome.prompt_tokens = delta.prompt_tokens
            if delta.completion_tokens:
                self.outcome.completion_tokens = delta.completion_tokens
            self.outcome.metrics = delta.metrics
            self.upstream_usage = delta.usage
        return delta.text

    async def deltas(self) -> AsyncIterator[str]:
        """Text pieces (and, when relaying, one item per upstream chunk, "" if it has no text); records
        finish reason, counts and metrics from the final delta."""
        if self._iterator is None:
            await self.start()
        try:
            if self._first is not None:
                first, self._first = self._first, None
                text = self._take(first)
                if text or first.raw is not None:  # relayed chunks go out as they come, text or not
                    yield text
            if not self.finished:
                async for delta in self._iterator:
                    text = self._take(delta)
                    if text or delta.raw is not None:
                        yield text
        finally:
            if not self.finished:
                await self._stop_engine()

    def relayed_chunks(self) -> list[dict[str, Any]]:
        """Upstream chunks not yet sent to a streaming client (taken: each is sent once)."""
        chunks, self.chunks = self.chunks, []
        return chunks

    def usage_body(self, usage: Usage) -> dict[str, Any]:
        """`usage` as the client gets it: the upstream's own object plus `ctxgate` when relaying."""
        if self.relayed and self.upstream_usage:
            return {**self.upstream_usage, "ctxgate": usage.model_extra.get("ctxgate")}
        return usage.model_dump()

    async def drain(self) -> None:
        """Run the request to the end, keeping only what `outcome` records."""
        async for _ in self.deltas():
            pass

    def observe_latency(self, endpoint: str) -> None:
        metrics = self.gateway.metrics
        started = self.prepared.received_at
        if self.first_token_at is not None:
            metrics.ttft_seconds.observe(self.first_token_at - started)
            if self.outcome.completion_tokens > 1 and self.last_token_at is not None:
                metrics.tpot_seconds.observe(
                    (self.last_token_at - self.first_token_at) / (self.outcome.completion_tokens - 1)
                )
        metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - started)


async def _bounded(iterator: AsyncIterator[Any], timeout_s: float | None, started: float) -> AsyncIterator[Any]:
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


async def _complete(request: Request, run: _Run, writer: ResponseWriter) -> JSONResponse:
    gateway, prepared = run.gateway, run.prepared
    try:
        await unless_disconnected(request, run.drain())
    except ClientDisconnected:  # generation was cancelled (which aborted it upstream): bill what ran
        await gateway.settle(prepared, run.outcome, count_metrics=False)
        raise
    except Exception as exc:
        if run.first_token_at is None:
            await gateway.release(prepared)  # the backend did no work: give the quota back
        else:
            await gateway.settle(prepared, run.outcome, count_metrics=False)
        raise gateway.engine_error(exc) from None
    usage = await gateway.settle(prepared, run.outcome)
    run.observe_latency(request.url.path)
    if run.relayed:  # the upstream's answer as it is; only the model name (rewritten going up) and usage
        whole = fold_chunks(run.chunks, writer.chat) | {"model": writer.model, "usage": run.usage_body(usage)}
        return JSONResponse(whole)
    return JSONResponse(writer.whole(run.outcome.text, run.outcome.finish_reason, usage))


async def _stream(run: _Run, writer: ResponseWriter, endpoint: str, include_usage: bool) -> StreamingResponse:
    try:
        await run.start()
    except Exception as exc:
        await run.gateway.release(run.prepared)  # refused before any work: give the quota back
        raise run.gateway.engine_error(exc) from None
    return event_stream_response(_events(run, writer, endpoint, include_usage))


async def _events(run: _Run, writer: ResponseWriter, endpoint: str, include_usage: bool) -> AsyncIterator[str]:
    gateway, prepared = run.gateway, run.prepared
    settled = False
    try:
        for event in [] if run.relayed else writer.opening():
            yield event
        try:
            async for text in run.deltas():
                if not run.relayed and text:
                    yield writer.text(text)
                for chunk in run.relayed_chunks():
                    yield _relay(chunk, writer)
        except Exception as exc:  # headers are sent: report in-band, as OpenAI does
            yield sse_event(gateway.engine_error(exc).body())
            yield DONE
            return
        usage = await gateway.settle(prepared, run.outcome)
        settled = True
        run.observe_latency(endpoint)
        for chunk in run.relayed_chunks():  # chunks after the last text (tool calls, the finish reason)
            yield _relay(chunk, writer)
        if not run.relayed:
            yield writer.finish(run.outcome.finish_reason)
        if include_usage and run.relayed:  # the upstream's envelope (id, created), the gateway's usage
            yield sse_event({"id": run.upstream_id or writer.response_id,
                             "object": "chat.completion.chunk" if writer.chat else "text_completion",
                             "created": writer.created, "model": writer.model,
                             "choices": [], "usage": run.usage_body(usage)})
        elif include_usage:
            yield writer.usage(usage)
        yield DONE
    finally:
        if not settled:
            await asyncio.shield(gateway.settle(prepared, run.outcome, count_metrics=False))


def _relay(chunk: dict[str, Any], writer: ResponseWriter) -> str:
    """An upstream chunk as it came, under the model name the client asked for; usage is sent once,
    at the end, with the gateway's accounting added."""
    return sse_event({key: value for key, value in chunk.items() if key != "usage"} | {"model": writer.model})
