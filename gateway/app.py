"""The FastAPI application: OpenAI-compatible routes on top of `gateway.service.Gateway`.

`create_app(settings, engine=None, pipeline=None)` builds everything; tests and the eval harness run
it in-process. Without an engine it starts the in-process engine, or the HTTP upstream client when
`settings.upstreams` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from backend.api import EngineClient, GenerationRequest
from gateway.admission import AdmissionCollector, AdmissionControl, AdmissionController
from gateway.errors import APIError, BodyTooLarge, install_error_handlers, validation_message
from gateway.keys import KeyStore
from gateway.metrics import GatewayMetrics
from gateway.openapi import document_request_bodies
from gateway.pipeline import BudgetOnlyPipeline, Pipeline
from gateway.quota import create_store
from gateway.request_id import RequestId
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.service import Gateway, Outcome, Prepared
from gateway.settings import GatewaySettings
from policies.loader import PolicyRegistry, ReloadError, packaged_policy_dir

logger = logging.getLogger(__name__)


# -- construction --------------------------------------------------------------------------------
def _default_engine(settings: GatewaySettings) -> EngineClient:
    if settings.upstreams:
        from backend.upstream import UpstreamClient, UpstreamConfig

        config = UpstreamConfig(
            urls=list(settings.upstreams), model=settings.upstream_model,
            connect_timeout_s=settings.upstream_connect_timeout_s,
            read_timeout_s=settings.upstream_read_timeout_s, retries=settings.upstream_retries,
        )
        return UpstreamClient(config, served_model_name=settings.served_model_name or settings.upstream_model)
    from backend.async_engine import AsyncEngine  # noqa: I001 (lands with the engine branch)
    from backend.config import EngineConfig
    from backend.model_prepare import prepare_default_model

    return AsyncEngine(EngineConfig(model=str(settings.model or prepare_default_model())),
                       max_waiting_requests=settings.engine_max_waiting_requests)


def _tokenizer_for(settings: GatewaySettings, engine: EngineClient) -> Any:
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    from backend.model_prepare import prepare_default_model
    from backend.tokenizer import load_tokenizer

    return load_tokenizer(str(settings.model or prepare_default_model()))


def default_pipeline(tokenizer: Any, engine: EngineClient, index_dir: Any = None) -> Pipeline:
    """The compression package's pipeline; the budget-only pipeline where it is not installed."""
    try:
        from compression.pipeline import CompressionPipeline
    except ModuleNotFoundError as exc:
        logger.warning("compression pipeline unavailable (%s); enforcing the budget without compression", exc)
        return BudgetOnlyPipeline(tokenizer)
    # The engine serves history summaries at background priority; an HTTP upstream is used the same way.
    return CompressionPipeline(tokenizer, engine=engine, index_dir=index_dir)


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


class BodySizeLimit:
    """Refuse bodies over the limit before they are buffered (413), by header or by counting."""

    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_large = int(value) > self.max_body_bytes
                except ValueError:
                    too_large = False
                if too_large:
                    response = APIError(413, str(BodyTooLarge(self.max_body_bytes)), code="body_too_large")
                    return await response.response()(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        return await self.app(scope, counting_receive, send)


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
) -> FastAPI:
    metrics = GatewayMetrics()
    owns_engine = engine is None
    engine = engine if engine is not None else _default_engine(settings)
    tokenizer = _tokenizer_for(settings, engine)
    pipeline = pipeline if pipeline is not None else default_pipeline(tokenizer, engine, settings.index_dir)
    gateway = Gateway(
        settings=settings, engine=engine, tokenizer=tokenizer, pipeline=pipeline,
        policies=_policy_registry(settings, metrics), keys=KeyStore(settings.keys_file),
        store=create_store(settings.redis_url), metrics=metrics,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await _maybe_call(engine, "start")
        # Load compression models (embedder, reranker) before the first request, where supported.
        await _maybe_call(pipeline, "warmup")
        if hasattr(engine, "check_health"):
            await engine.check_health()
        watcher = asyncio.create_task(_watch_files(gateway), name="ctxgate-reload")
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await gateway.store.close()
            if owns_engine:
                for method in ("shutdown", "stop", "close"):
                    if await _maybe_call(engine, method):
                        break

    app = FastAPI(title="ctxgate", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gateway
    install_error_handlers(app)
    _add_routes(app, gateway)
    document_request_bodies(app)
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes)
    app.state.admission = AdmissionController(settings.max_in_flight, settings.max_queued, settings.queue_timeout_s)
    app.add_middleware(AdmissionControl, controller=app.state.admission)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(RequestId, access_log=settings.access_log)  # outermost: every answer carries the id
    metrics.registry.register(AdmissionCollector(app.state.admission))
    return app


async def _maybe_call(target: Any, method: str) -> bool:
    function = getattr(target, method, None)
    if function is None:
        return False
    result = function()
    if asyncio.iscoroutine(result):
        await result
    return True


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
            if getattr(gateway.engine, "needs_health_check", False) and ticks % 3 == 0:
                await gateway.engine.check_health()
        except Exception:  # the watcher must survive anything a file can do to it
            logger.exception("policy/keys reload failed")


# -- request parsing -----------------------------------------------------------------------------
async def _parse(request: Request, model: type[BaseModel]) -> Any:
    if "json" not in request.headers.get("content-type", "application/json"):
        raise APIError(415, "Content-Type must be application/json", code="unsupported_media_type")
    raw = await request.body()
    if not raw:
        raise APIError(400, "request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "malformed JSON: nested too deeply", code="invalid_json") from None
    try:  # JSON escapes can smuggle lone surrogates, which no tokenizer can encode
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "malformed JSON: a string holds an unpaired UTF-16 surrogate", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False))
        raise APIError(400, message, param=param, code="invalid_value") from None


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON; Python would accept them and they poison arithmetic downstream.
    raise ValueError(f"{name} is not valid JSON")


def _usage_wanted(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


# -- routes --------------------------------------------------------------------------------------
def _add_routes(app: FastAPI, gateway: Gateway) -> None:
    metrics = gateway.metrics

    def tenant_of(request: Request):
        return gateway.authenticate(request.headers.get("authorization"), request.headers.get("x-api-key"))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        engine_ready = bool(gateway.engine.is_ready()) and not app.state.admission.draining
        store_ready = await gateway.store.ping()
        metrics.quota_store_up.set(1 if store_ready else 0)
        body = {"status": "ready" if engine_ready and store_ready else "not ready",
                "engine": engine_ready, "store": store_ready, "store_kind": gateway.store.name}
        return JSONResponse(body, status_code=200 if engine_ready and store_ready else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        payload = generate_latest(metrics.registry)
        engine_metrics = getattr(gateway.engine, "metrics", None)
        engine_registry = getattr(engine_metrics, "registry", None)
        if engine_registry is not None:
            payload += generate_latest(engine_registry)
        return Response(payload, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        tenant_of(request)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "ctxgate",
             "max_model_len": gateway.engine.max_model_len}
            for name in gateway.model_names
        ]}

    @app.get("/v1/ctxgate/policies")
    async def policies(request: Request) -> dict[str, Any]:
        tenant_of(request)
        errors = gateway.policies.errors()
        return {
            "default": gateway.settings.default_policy,
            "policies": [
                {"name": item.policy.name, "file": item.path, "loaded_at": item.loaded_at,
                 "effective": gateway._fit_to_model(item.policy).model_dump(mode="json")}
                for item in gateway.policies.loaded()
            ],
            "errors": [{"file": err.path, "message": err.message, "at": err.at} for err in errors],
            "last_reload_error": (
                {"file": errors[-1].path, "message": errors[-1].message, "at": errors[-1].at} if errors else None
            ),
        }

    @app.post("/v1/ctxgate/compress")
    async def compress(request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        body = await _parse(request, ChatCompletionRequest)
        gateway.check_model(body.model, tenant)
        policy = gateway.resolve_policy(tenant, body.ctxgate)
        _, result = await gateway.compress(body, tenant, policy)
        gateway.encode_checked(result, policy)
        # Compression is metered like a request that generates nothing: one request, its prompt tokens.
        reservation = await gateway.reserve(tenant, policy, result.prompt_tokens, 0)
        del reservation
        return {
            "messages": result.messages,
            "policy": policy.name,
            "report": {
                "original_prompt_tokens": result.original_prompt_tokens,
                "prompt_tokens": result.prompt_tokens,
                "saved_tokens": result.saved_tokens,
                "compression_ms": result.compression_ms,
                "stages": [{"name": s.name, "saved_tokens": s.saved_tokens, "ms": round(s.ms, 3),
                            "details": s.details} for s in result.stages],
            },
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = tenant_of(request)
        body = await _parse(request, ChatCompletionRequest)
        prepared = await gateway.prepare_chat(body, tenant)
        generation = GenerationRequest(
            request_id=prepared.request_id, prompt_token_ids=prepared.prompt_token_ids,
            sampling=prepared.sampling, priority=prepared.priority, cache_salt=tenant.name,
            messages=prepared.result.messages, prompt_text=prepared.prompt_text,
        )
        if body.stream:
            return await _stream(gateway, prepared, generation, body.model, chat=True, include_usage=_usage_wanted(body))
        return await _complete(gateway, request, prepared, generation, body.model, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = tenant_of(request)
        body = await _parse(request, CompletionRequest)
        prepared = await gateway.prepare_completion(body, tenant)
        generation = GenerationRequest(
            request_id=prepared.request_id, prompt_token_ids=prepared.prompt_token_ids,
            sampling=prepared.sampling, priority=prepared.priority, cache_salt=tenant.name,
            prompt_text=prepared.prompt_text,
        )
        if body.stream:
            return await _stream(gateway, prepared, generation, body.model, chat=False, include_usage=_usage_wanted(body))
        return await _complete(gateway, request, prepared, generation, body.model, chat=False)


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
        return delta.text

    async def deltas(self) -> AsyncIterator[str]:
        """Text pieces; records finish reason, counts and metrics from the final delta."""
        if self._iterator is None:
            await self.start()
        try:
            if self._first is not None:
                first, self._first = self._first, None
                if text := self._take(first):
                    yield text
            if not self.finished:
                async for delta in self._iterator:
                    if text := self._take(delta):
                        yield text
        finally:
            if not self.finished:
                await self._stop_engine()

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
        while True:
            remaining = started + timeout_s - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError(f"the request took longer than {timeout_s:g}s")
            try:
                item = await asyncio.wait_for(anext(iterator), remaining)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise TimeoutError(f"the request took longer than {timeout_s:g}s") from None
            yield item
    finally:
        with contextlib.suppress(Exception):
            await iterator.aclose()  # closing the wrapper closes the engine stream (frees its blocks)


def _choice(chat: bool, text: str, finish_reason: str | None, streaming: bool) -> dict[str, Any]:
    if chat and streaming:
        delta = {"content": text} if text else {}
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    if chat:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                "logprobs": None}
    return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}


async def _complete(
    gateway: Gateway, request: Request, prepared: Prepared, generation: GenerationRequest, model: str, chat: bool
) -> JSONResponse:
    run = _Run(gateway, prepared, generation)

    async def consume() -> None:
        async for _ in run.deltas():
            pass

    consumer = asyncio.create_task(consume())
    disconnect = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({consumer, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():  # the client left: cancel generation (its finally aborts upstream)
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await consumer
            await gateway.settle(prepared, run.outcome, count_metrics=False)
            return JSONResponse({"error": {"message": "client disconnected", "type": "aborted",
                                           "param": None, "code": None}}, status_code=499)
        try:
            consumer.result()
        except Exception as exc:
            if run.first_token_at is None:
                await gateway.release(prepared)  # the backend did no work: give the quota back
            else:
                await gateway.settle(prepared, run.outcome, count_metrics=False)
            raise gateway.engine_error(exc) from None
    finally:
        disconnect.cancel()
    usage = await gateway.settle(prepared, run.outcome)
    run.observe_latency(request.url.path)
    endpoint_object = "chat.completion" if chat else "text_completion"
    return JSONResponse({
        "id": prepared.request_id, "object": endpoint_object, "created": prepared.created, "model": model,
        "choices": [_choice(chat, run.outcome.text, run.outcome.finish_reason, streaming=False)],
        "usage": usage,
    })


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(
    gateway: Gateway, prepared: Prepared, generation: GenerationRequest, model: str, chat: bool,
    include_usage: bool,
) -> StreamingResponse:
    run = _Run(gateway, prepared, generation)
    try:
        await run.start()
    except Exception as exc:
        await gateway.release(prepared)  # refused before any work: give the quota back
        raise gateway.engine_error(exc) from None
    chunk_object = "chat.completion.chunk" if chat else "text_completion"
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return _sse({"id": prepared.request_id, "object": chunk_object, "created": prepared.created,
                     "model": model, "choices": choices, **extra})

    async def events() -> AsyncIterator[str]:
        settled = False
        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None}])
            try:
                async for text in run.deltas():
                    yield chunk([_choice(chat, text, None, streaming=True)])
            except Exception as exc:  # headers are sent: report in-band, as OpenAI does
                error = gateway.engine_error(exc)
                yield _sse(error.body())
                yield "data: [DONE]\n\n"
                return
            usage = await gateway.settle(prepared, run.outcome)
            settled = True
            run.observe_latency(endpoint)
            yield chunk([_choice(chat, "", run.outcome.finish_reason, streaming=True)])
            if include_usage:
                yield chunk([], usage=usage)
            yield "data: [DONE]\n\n"
        finally:
            if not settled:
                await asyncio.shield(gateway.settle(prepared, run.outcome, count_metrics=False))

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
