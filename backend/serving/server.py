"""`ctxgate engine serve`: the built-in engine behind an OpenAI-compatible HTTP API.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as SSE or not), GET /v1/models,
GET /metrics, GET /health. Accepts the vLLM-style sampling extras (`top_k`, `ignore_eos`,
`stop_token_ids`, `seed`, `cache_salt`, `priority`). Every refusal is an OpenAI-style JSON error
with a 4xx status; nothing a client sends can produce a 500. The wire protocol itself (bodies,
errors, SSE) is `ctxgate.backend.openai_api`, shared with the gateway.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from ctxgate.backend.engine.api import EngineError, GenerationRequest, Priority, SamplingParams
from ctxgate.backend.engine.async_engine import AsyncEngine
from ctxgate.backend.engine.deltas import DeltaTotals
from ctxgate.backend.engine.guided import compiler_for
from ctxgate.backend.engine.request_stream import RequestStream
from ctxgate.backend.model.tokenizer import Tokenizer
from ctxgate.backend.openai_api.errors import APIError, install_error_handlers
from ctxgate.backend.openai_api.fields import enforce_supported
from ctxgate.backend.openai_api.http import (
    BearerAuth,
    document_request_bodies,
    parse_body,
    unless_disconnected,
)
from ctxgate.backend.openai_api.request_params import EngineAsks, engine_asks
from ctxgate.backend.openai_api.responses import ResponseWriter, Usage
from ctxgate.backend.openai_api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from ctxgate.backend.openai_api.sse import DONE, event_stream_response, sse_event

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
ERROR_ANSWERS = {
    "400": "invalid request (OpenAI-style error object)",
    "404": "unknown model",
    "503": "the engine is overloaded or shut down",
}


# ---------------------------------------------------------------------------- the served engine
@dataclass(frozen=True)
class EngineServer:
    """What every route needs: the engine and the model names it answers to."""

    engine: AsyncEngine
    model_name: str
    accepted_model_names: frozenset[str]
    drop_params: bool = False  # drop (instead of refusing) fields the engine cannot honour

    @classmethod
    def for_engine(
        cls, engine: AsyncEngine, served_model_name: str | None, drop_params: bool = False
    ) -> EngineServer:
        model_name = served_model_name or engine.model_name
        # Clients may name the model as served, by the engine's own name, or by its path.
        names = {model_name, engine.model_name, str(engine.config.model or "")} - {""}
        return cls(engine, model_name, frozenset(names), drop_params)

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in self.accepted_model_names:
            raise APIError(
                404,
                f"The model `{requested}` does not exist. This server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def sampling_for(
        self, body: SamplingFields, max_tokens: int | None, prompt_len: int, extras: dict | None = None
    ) -> SamplingParams:
        """Sampling parameters, with `max_tokens` checked against (or defaulted to) the room left."""
        max_model_len = self.engine.max_model_len
        if prompt_len >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                f"has {prompt_len} tokens, which leaves no room for output. Please shorten the prompt.",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is not None and prompt_len + max_tokens > max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else max_model_len - prompt_len,
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            **(extras or {}),
        )

    async def submit(
        self, body: SamplingFields, prompt_ids: list[int], max_tokens: int | None, asks: EngineAsks
    ) -> RequestStream:
        """Hand the request to the engine; raises its EngineError if it refuses (e.g. overload)."""
        return await self.engine.add_request(
            GenerationRequest(
                request_id=uuid.uuid4().hex,
                prompt_token_ids=prompt_ids,
                sampling=self.sampling_for(body, max_tokens, len(prompt_ids), asks.sampling),
                priority=_priority_from(body.priority),
                cache_salt=body.cache_salt,
                # A ctxgate gateway sends each tenant's own salt, so it also names the fair-queuing tenant.
                tenant=body.cache_salt,
            )
        )


def _priority_from(value: int) -> Priority:
    # vLLM convention: lower value is more urgent; anything above 0 counts as background work.
    return Priority.USER if value <= 0 else Priority.BACKGROUND


def _completion_prompt_ids(body: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    text = body.prompt_text()
    ids = tokenizer.encode(text) if text is not None else body.prompt_token_ids() or []
    if not ids:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if text is None and any(not 0 <= token_id < tokenizer.vocab_size for token_id in ids):
        raise APIError(400, f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
    return ids


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """The messages as the chat template takes them, tool-call turns and tool results included."""
    return [
        {"role": m.role, "content": m.text() if m.content is not None or m.role != "assistant" else None}
        | {
            key: value
            for key, value in (m.model_extra or {}).items()
            if key in ("tool_calls", "tool_call_id")
        }
        | ({"name": m.name} if m.name else {})
        for m in body.messages
    ]


def _chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Tokenizer, asks: EngineAsks) -> list[int]:
    tools = asks.output.tools.template_tools() if asks.output.tools else None
    try:
        return tokenizer.encode_chat(chat_messages(body), tools=tools)
    except Exception as exc:  # template errors (e.g. roles the template rejects) are the client's
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None


# ---------------------------------------------------------------------------- one request's answer
async def _answer(
    request: Request,
    server: EngineServer,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    asks: EngineAsks,
) -> Response:
    chat = isinstance(body, ChatCompletionRequest)
    stream = await server.submit(body, prompt_ids, max_tokens, asks)
    writer = ResponseWriter(
        f"{'chatcmpl' if chat else 'cmpl'}-{stream.request_id}",
        server.model_name,
        int(time.time()),
        chat,
        asks.output,
    )
    if body.stream:
        return event_stream_response(_events(stream, writer, len(prompt_ids), body.usage_wanted(), body.n))
    totals = await unless_disconnected(request, _collect(stream, len(prompt_ids)))
    for index in range(body.n):
        totals.choice(index)
    return JSONResponse(writer.whole_choices(totals.ordered_choices(), _usage(totals)))


def _usage(totals: DeltaTotals) -> Usage:
    return Usage.of(totals.prompt_tokens, totals.completion_tokens, totals.cached_prompt_tokens)


async def _collect(stream: RequestStream, prompt_tokens: int) -> DeltaTotals:
    totals = DeltaTotals(prompt_tokens=prompt_tokens)
    try:
        async for delta in stream:
            totals.add(delta)
    finally:
        stream.close()  # a no-op once finished; if the client left, it aborts and frees the KV blocks
    return totals


async def _events(
    stream: RequestStream, writer: ResponseWriter, prompt_tokens: int, include_usage: bool, num_choices: int
) -> AsyncIterator[str]:
    totals = DeltaTotals(prompt_tokens=prompt_tokens)
    try:
        for event in writer.opening(num_choices):
            yield event
        async for delta in stream:
            totals.add(delta)
            for event in writer.delta_events(delta, totals):
                yield event
        if include_usage:
            yield writer.usage(_usage(totals))
    except EngineError as exc:  # headers are sent: report in-band, as OpenAI does
        yield sse_event(APIError(exc.status_code, str(exc), param=exc.param, code=exc.code).body())
    finally:
        stream.close()  # the client went away (or we are done): make sure the KV blocks are freed
    yield DONE


# ---------------------------------------------------------------------------- routes
def _server(request: Request) -> EngineServer:
    return request.app.state.server


def _client(request: Request) -> str:
    """Whose turn a grammar compile takes here: the engine server has no tenants (one key at most),
    so each client address queues as one."""
    return f"client:{request.client.host}" if request.client is not None else "client:-"


async def completions(request: Request) -> Response:
    server = _server(request)
    body = await parse_body(request, CompletionRequest)
    server.check_model(body.model)
    enforce_supported(body, server.drop_params)
    asks = await engine_asks(body, server.engine.tokenizer, _client(request))
    prompt_ids = _completion_prompt_ids(body, server.engine.tokenizer)
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    return await _answer(request, server, body, prompt_ids, max_tokens, asks)


async def chat_completions(request: Request) -> Response:
    server = _server(request)
    body = await parse_body(request, ChatCompletionRequest)
    server.check_model(body.model)
    enforce_supported(body, server.drop_params)
    asks = await engine_asks(body, server.engine.tokenizer, _client(request))
    prompt_ids = _chat_prompt_ids(body, server.engine.tokenizer, asks)
    return await _answer(request, server, body, prompt_ids, body.requested_max_tokens(), asks)


async def models(request: Request) -> dict:
    server = _server(request)
    return {
        "object": "list",
        "data": [
            {
                "id": server.model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "ctxgate",
                "root": str(server.engine.config.model or server.model_name),
                "max_model_len": server.engine.max_model_len,
                "engine_path": server.engine.path_info,
            }
        ],
    }


async def metrics(request: Request) -> Response:
    return Response(_server(request).engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def health(request: Request) -> dict:
    server = _server(request)
    if not server.engine.is_ready():
        raise APIError(503, "the engine is not running")
    return {"status": "ok", "model": server.model_name}


async def _answer_engine_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EngineError)
    return APIError(exc.status_code, str(exc), param=exc.param, code=exc.code).response()


@asynccontextmanager
async def _run_engine(app: FastAPI) -> AsyncIterator[None]:
    engine: AsyncEngine = app.state.server.engine
    engine.start()
    await asyncio.to_thread(compiler_for(engine.tokenizer).warm_up)  # grammar workers start now
    yield
    await engine.stop()


# ---------------------------------------------------------------------------- application
def create_app(
    engine: AsyncEngine,
    served_model_name: str | None = None,
    manage_engine: bool = True,
    api_key: str | None = None,
    drop_params: bool = False,
) -> FastAPI:
    """The FastAPI app around `engine`. With `manage_engine` the app starts and stops the engine;
    with `api_key` every /v1 route needs `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="ctxgate engine", lifespan=_run_engine if manage_engine else None)
    app.state.server = EngineServer.for_engine(engine, served_model_name, drop_params)
    install_error_handlers(app)
    app.add_exception_handler(EngineError, _answer_engine_error)
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    document_request_bodies(app, REQUEST_BODIES, ERROR_ANSWERS)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app


def serve(
    engine: AsyncEngine,
    host: str = "127.0.0.1",
    port: int = 8001,
    log_level: str = "info",
    served_model_name: str | None = None,
    api_key: str | None = None,
    drop_params: bool = False,
) -> None:
    """Run the server in the foreground until interrupted."""
    import uvicorn

    app = create_app(engine, served_model_name, api_key=api_key, drop_params=drop_params)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
