"""`ctxgate engine serve`: the built-in engine behind an OpenAI-compatible HTTP API.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as SSE or not), GET /v1/models,
GET /metrics, GET /health. Accepts the vLLM-style sampling extras (`top_k`, `ignore_eos`,
`stop_token_ids`, `seed`, `cache_salt`, `priority`). Every refusal is an OpenAI-style JSON error
with a 4xx status; nothing a client sends can produce a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.api import EngineError, GenerationDelta, GenerationRequest, Priority, SamplingParams
from backend.async_engine import AsyncEngine, RequestStream

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- request schemas
class _OpenAIRequest(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do, so newer SDKs keep working.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None


_OpenAIRequest.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


# ---------------------------------------------------------------------------- errors
class APIError(Exception):
    def __init__(self, message: str, status_code: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code


_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_response(message: str, status_code: int, param: str | None = None, code: str | None = None) -> JSONResponse:
    error_type = _ERROR_TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status_code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    problems = []
    param = None
    for error in exc.errors():
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            return f"The request body is not valid JSON: {error.get('msg')}", None
        where = ".".join(location) or "body"
        param = param or (location[0] if location else None)
        problems.append(f"{where}: {error.get('msg')}")
    return "Invalid request: " + "; ".join(problems), param


# ---------------------------------------------------------------------------- translation
def _sampling_from(body: _OpenAIRequest, max_tokens: int | None, prompt_len: int, max_model_len: int) -> SamplingParams:
    if body.n != 1:
        raise APIError("only n=1 is supported", param="n")
    room = max_model_len - prompt_len
    if prompt_len >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for output. Please shorten the prompt.",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > 0 and prompt_len + max_tokens > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        seed=body.seed,
        stop=[s for s in stop if s],
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
    )
    try:
        sampling.validate()
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise APIError(str(exc), param=param) from None
    return sampling


def _priority_from(value: int) -> Priority:
    # vLLM convention: lower value is more urgent; anything above 0 counts as background work.
    return Priority.USER if value <= 0 else Priority.BACKGROUND


def _message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for part in message.content:
        if part.type != "text":
            raise APIError(f"content parts of type {part.type!r} are not supported", param="messages")
        parts.append(part.text or "")
    return "".join(parts)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class _Outcome:
    """What a finished request produced, folded from its deltas."""

    def __init__(self, prompt_tokens: int):
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0

    def add(self, delta: GenerationDelta) -> None:
        self.text_parts.append(delta.text)
        self.completion_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            if delta.prompt_tokens:
                self.prompt_tokens = delta.prompt_tokens
            if delta.completion_tokens:
                self.completion_tokens = delta.completion_tokens
            if delta.metrics is not None:
                self.cached_tokens = delta.metrics.cached_prompt_tokens

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


# ---------------------------------------------------------------------------- application
def create_app(engine: AsyncEngine, served_model_name: str | None = None, manage_engine: bool = True) -> FastAPI:
    """The FastAPI app around `engine`. With `manage_engine` the app starts and stops the engine."""
    model_name = served_model_name or engine.model_name
    accepted_model_names = {model_name, engine.model_name, str(getattr(engine.config, "model", "") or "")}
    accepted_model_names.discard("")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            engine.start()
        yield
        if manage_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="ctxgate engine", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status_code, exc.param, exc.code)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return error_response(str(exc), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(f"internal error: {type(exc).__name__}", 500)

    def check_model(requested: str | None) -> None:
        if requested is not None and requested not in accepted_model_names:
            raise APIError(
                f"The model `{requested}` does not exist. This server serves `{model_name}`.",
                status_code=404, param="model", code="model_not_found",
            )

    async def submit(body: _OpenAIRequest, prompt_ids: list[int], max_tokens: int | None) -> tuple[RequestStream, str]:
        sampling = _sampling_from(body, max_tokens, len(prompt_ids), engine.max_model_len)
        request_id = uuid.uuid4().hex
        stream = await engine.add_request(
            GenerationRequest(
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                sampling=sampling,
                priority=_priority_from(body.priority),
                cache_salt=body.cache_salt,
            )
        )
        return stream, request_id

    async def collect(request: Request, stream: RequestStream, prompt_tokens: int) -> _Outcome:
        """Run a request to completion, aborting it if the client disconnects meanwhile."""
        outcome = _Outcome(prompt_tokens)

        async def consume() -> None:
            async for delta in stream:
                outcome.add(delta)

        async def wait_for_disconnect() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(wait_for_disconnect())
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
                stream.close()
                await asyncio.gather(consumer, return_exceptions=True)
        if consumer.cancelled():
            raise APIError("client disconnected", status_code=499)
        consumer.result()
        return outcome

    def stream_response(events: AsyncIterator[bytes], stream: RequestStream) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in events:
                    yield chunk
            finally:
                # The client went away (or we are done): make sure the KV blocks are freed.
                stream.close()

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.logprobs:
            raise APIError("logprobs are not supported", param="logprobs")
        if body.echo:
            raise APIError("echo is not supported", param="echo")
        prompt_ids = _completion_prompt_ids(body, engine)
        stream, request_id = await submit(body, prompt_ids, body.max_tokens)
        created = int(time.time())
        response_id = f"cmpl-{request_id}"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        if not body.stream:
            outcome = await collect(request, stream, len(prompt_ids))
            return {
                "id": response_id, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "text": outcome.text, "logprobs": None,
                             "finish_reason": outcome.finish_reason}],
                "usage": _usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens),
            }

        async def events() -> AsyncIterator[bytes]:
            outcome = _Outcome(len(prompt_ids))
            async for delta in stream:
                outcome.add(delta)
                if not delta.text and delta.finish_reason is None:
                    continue
                yield _sse({
                    "id": response_id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": delta.text, "logprobs": None,
                                 "finish_reason": delta.finish_reason}],
                })
            if include_usage:
                yield _sse({
                    "id": response_id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [],
                    "usage": _usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens),
                })
            yield b"data: [DONE]\n\n"

        return stream_response(events(), stream)

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if body.logprobs:
            raise APIError("logprobs are not supported", param="logprobs")
        messages = [{"role": m.role, "content": _message_text(m)} for m in body.messages]
        try:
            prompt_ids = engine.tokenizer.encode_chat(messages)
        except Exception as exc:  # template errors (e.g. roles the template rejects) are the client's
            raise APIError(f"cannot apply the chat template: {exc}", param="messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        stream, request_id = await submit(body, prompt_ids, max_tokens)
        created = int(time.time())
        response_id = f"chatcmpl-{request_id}"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        if not body.stream:
            outcome = await collect(request, stream, len(prompt_ids))
            return {
                "id": response_id, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": outcome.text},
                             "logprobs": None, "finish_reason": outcome.finish_reason}],
                "usage": _usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens),
            }

        def chunk(delta: dict[str, Any], finish_reason: str | None) -> bytes:
            return _sse({
                "id": response_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
            })

        async def events() -> AsyncIterator[bytes]:
            outcome = _Outcome(len(prompt_ids))
            yield chunk({"role": "assistant", "content": ""}, None)
            async for delta in stream:
                outcome.add(delta)
                if delta.text:
                    yield chunk({"content": delta.text}, None)
                if delta.finish_reason is not None:
                    yield chunk({}, delta.finish_reason)
            if include_usage:
                yield _sse({
                    "id": response_id, "object": "chat.completion.chunk", "created": created,
                    "model": model_name, "choices": [],
                    "usage": _usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens),
                })
            yield b"data: [DONE]\n\n"

        return stream_response(events(), stream)

    # ------------------------------------------------------------------ the rest
    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "ctxgate",
                      "root": str(getattr(engine.config, "model", None) or model_name),
                      "max_model_len": engine.max_model_len}],
        }

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        if engine.is_ready():
            return {"status": "ok", "model": model_name}
        return error_response("the engine is not running", 503)

    return app


def _completion_prompt_ids(body: CompletionRequest, engine: AsyncEngine) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, str):
        ids = engine.tokenizer.encode(prompt)
        if not ids:
            raise APIError("prompt must not be empty", param="prompt")
        return ids
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    if all(isinstance(item, int) for item in prompt):
        ids = list(prompt)
    elif len(prompt) == 1:
        only = prompt[0]
        ids = engine.tokenizer.encode(only) if isinstance(only, str) else list(only)
    else:
        raise APIError("only one prompt per request is supported", param="prompt")
    vocab_size = engine.tokenizer.vocab_size
    if any(not 0 <= token_id < vocab_size for token_id in ids):
        raise APIError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    if not ids:
        raise APIError("prompt must not be empty", param="prompt")
    return ids


def serve(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 8001, log_level: str = "info") -> None:
    """Run the server in the foreground until interrupted."""
    import uvicorn

    uvicorn.run(create_app(engine), host=host, port=port, log_level=log_level)
