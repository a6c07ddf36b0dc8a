"""`x-request-id` correlation and the access log (pure ASGI middleware; streams pass through untouched).

A client's `x-request-id` is kept when it is a sane token (so a request can be followed from the
client's own logs), otherwise one is generated; either way it is echoed on the response. With the
access log on (the default), one line per request carries request id, method, path (never the
query string), status, tenant, policy, prompt tokens before and after compression, time to first
token and total duration: never a key, a header value or any part of the body, so the log stays
safe to ship off the machine. The service notes the per-request figures (`note_tenant`,
`note_usage`) into the request's context; a figure not noted (a 401, a /health) is written `-`.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

HEADER = b"x-request-id"
# Letters, digits and . _ : - only, bounded: a header value must not be able to forge log lines.
_VALID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

_UNSAFE = re.compile(r"[^\x21-\x7e]")

access_logger = logging.getLogger("ctxgate.access")


@dataclass
class RequestContext:
    request_id: str
    tenant: str | None = None
    # When the request reached the gateway (perf_counter): TTFT and the request timeout count from
    # here, so the time spent reading, compressing and tokenizing the request is in them.
    received_at: float = field(default_factory=time.perf_counter)
    policy: str | None = None
    original_prompt_tokens: int | None = None  # before compression
    prompt_tokens: int | None = None  # sent to the model
    ttft_ms: float | None = None  # from `received_at` to the first token, as the client sees it


_current: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "ctxgate_request", default=None
)


def current_request() -> RequestContext | None:
    """The request being served in this task, or None outside a request."""
    return _current.get()


def received_at() -> float:
    """When the request being served reached the gateway; now outside a request (a direct call)."""
    context = _current.get()
    return context.received_at if context is not None else time.perf_counter()


def note_tenant(name: str) -> None:
    """Record the authenticated tenant for the access log (a mutable holder: visible to the middleware
    even when the handler ran in a copied context)."""
    context = _current.get()
    if context is not None:
        context.tenant = name


def note_usage(policy: str, original_prompt_tokens: int, prompt_tokens: int, ttft_ms: float | None) -> None:
    """Record a generation's figures for the access log (called once its usage is settled)."""
    context = _current.get()
    if context is not None:
        context.policy = policy
        context.original_prompt_tokens = original_prompt_tokens
        context.prompt_tokens = prompt_tokens
        context.ttft_ms = ttft_ms


def _or_dash(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def access_line(context: RequestContext, method: str, path: str, status: int, duration_ms: float) -> str:
    """One request's access-log line: `name=value` pairs, values free of spaces (grep- and parser-friendly)."""
    return (
        f"request_id={context.request_id} method={method} path={loggable_path(path)} status={status} "
        f"tenant={_or_dash(context.tenant)} policy={_or_dash(context.policy)} "
        f"prompt_tokens_before={_or_dash(context.original_prompt_tokens)} "
        f"prompt_tokens_after={_or_dash(context.prompt_tokens)} ttft_ms={_or_dash(context.ttft_ms)} "
        f"duration_ms={duration_ms:.1f}"
    )


def loggable_path(path: str) -> str:
    """The path with spaces, control and non-ASCII characters percent-encoded: a decoded `%0A` in a
    URL must not start a forged log line."""
    return _UNSAFE.sub(lambda match: "".join(f"%{byte:02X}" for byte in match.group().encode()), path)


def accepted_or_new(value: bytes | None) -> str:
    if value:
        text = value.decode("latin-1")
        if _VALID.match(text):
            return text
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every log record emitted while a request is being served."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = _current.get()
        record.request_id = context.request_id if context is not None else "-"
        return True


class RequestId:
    def __init__(self, app, access_log: bool = True):
        self.app = app
        self.access_log = access_log
        if access_log:  # on unless turned off: not silenced by a WARNING root level (--no-access-log is)
            access_logger.setLevel(logging.INFO)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((value for name, value in scope.get("headers", []) if name == HEADER), None)
        context = RequestContext(accepted_or_new(given))
        scope.setdefault("state", {})["request_id"] = context.request_id
        token = _current.set(context)
        started = time.perf_counter()
        status = 500  # what the client gets if the app fails before starting a response

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(n, v) for n, v in message.get("headers", []) if n.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, context.request_id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
            if self.access_log:
                duration_ms = (time.perf_counter() - started) * 1000
                access_logger.info(
                    "%s",
                    access_line(
                        context, scope.get("method", "-"), scope.get("path", "-"), status, duration_ms
                    ),
                )
