"""HTTP mechanics of the OpenAI surface: strict JSON bodies, a body-size limit, client disconnects.

Routes parse their JSON by hand (`parse_body`) rather than through FastAPI's body binding, so that
malformed input (NaN, lone surrogates, a non-object, the wrong content type) gets the same
OpenAI-style 400/415 from both servers; `document_request_bodies` puts the models back into
`/openapi.json`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from ctxgate.backend.openai_api.errors import (
    APIError,
    BodyReadTimeout,
    BodyTooLarge,
    ClientDisconnected,
    invalid_value,
)

Model = TypeVar("Model", bound=BaseModel)
Result = TypeVar("Result")
ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


# -- request bodies ------------------------------------------------------------------------------
async def parse_body(request: Request, model: type[Model]) -> Model:
    """The request's JSON body as `model`, or an APIError (400/415) naming what is wrong."""
    parsed, _raw = await parse_body_and_json(request, model)
    return parsed


async def parse_body_and_json(request: Request, model: type[Model]) -> tuple[Model, dict[str, Any]]:
    """The body as `model` and as the JSON object the client sent (what an upstream is forwarded)."""
    if "json" not in request.headers.get("content-type", "application/json"):
        raise APIError(415, "Content-Type must be application/json", code="unsupported_media_type")
    data = parse_json_object(await request.body())
    try:
        return model.model_validate(data), data
    except ValidationError as exc:
        raise invalid_value(list(exc.errors(include_url=False))) from None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A JSON object from `raw`, refusing what Python's json accepts but JSON does not."""
    if not raw:
        raise APIError(400, "request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "malformed JSON: nested too deeply", code="invalid_json") from None
    try:  # JSON escapes can smuggle lone surrogates, which no tokenizer can encode
        if _may_hold_surrogates(raw):
            json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(
            400, "malformed JSON: a string holds an unpaired UTF-16 surrogate", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


# A `\uD800`-`\uDFFF` escape: in strict UTF-8 text the only way to spell a surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _may_hold_surrogates(raw: bytes) -> bool:
    """False when the parsed body cannot hold a lone surrogate: strict UTF-8 with no surrogate escape
    (re-encoding a deep body to find out costs more than parsing it). Other encodings, which json
    decodes with `surrogatepass`, always get the full check."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return _SURROGATE_ESCAPE.search(raw) is not None


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON; Python would accept them and they poison arithmetic downstream.
    raise ValueError(f"{name} is not valid JSON")


class BodySizeLimit:
    """ASGI middleware: refuse bodies over the limit before they are buffered (413), by header or by
    counting; with `read_timeout_s`, a body not fully received that long after the request started is
    cut off with 408 (uvicorn has no body timeout: a trickled body would hold a connection forever)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, read_timeout_s: float | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._declared_length(scope) > self.max_body_bytes:
            return await BodyTooLarge(self.max_body_bytes).response()(scope, receive, send)
        received = 0
        body_done = False
        deadline = (
            None if self.read_timeout_s is None else asyncio.get_running_loop().time() + self.read_timeout_s
        )

        async def counting_receive() -> dict:
            nonlocal received, body_done
            if body_done or deadline is None:
                # The body is in: later receives wait for a disconnect, as long as the answer takes.
                message = await receive()
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        message = await receive()
                except TimeoutError:
                    raise BodyReadTimeout(self.read_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
                body_done = not message.get("more_body", False)
            return message

        return await self.app(scope, counting_receive, send)

    @staticmethod
    def _declared_length(scope: dict) -> int:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0  # a garbled header: the counting receive still enforces the limit
        return 0


class BearerAuth:
    """ASGI middleware: paths under `prefix` need `Authorization: Bearer <api_key>` (401 otherwise),
    as vLLM's `--api-key`; health and metrics stay open for probes and scrapers."""

    def __init__(self, app: ASGIApp, api_key: str, prefix: str = "/v1"):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.prefix = prefix

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(self.prefix):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", [])).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):  # constant time: no key guessing by timing
            message = "missing API key (Authorization: Bearer <key>)" if not given else "invalid API key"
            refusal = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await refusal.response()(scope, receive, send)
        return await self.app(scope, receive, send)


# -- client disconnects --------------------------------------------------------------------------
async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has closed the connection (only for requests whose body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, Result]) -> Result:
    """The result of `work`; if the client disconnects first, `work` is cancelled (its `finally`
    blocks stop the generation) and ClientDisconnected is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


# -- OpenAPI -------------------------------------------------------------------------------------
def document_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]], errors: dict[str, str]) -> None:
    """Add the hand-parsed request `bodies` (path -> model) and the `errors` (status -> meaning) to
    the app's OpenAPI document, so clients, generators and schema-driven fuzzers know what to send."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            operation = schema["paths"].get(path, {}).get("post")
            if operation is None:
                continue
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
                },
            }
            for status, description in errors.items():
                operation["responses"].setdefault(status, {"description": description})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
