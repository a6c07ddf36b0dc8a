"""OpenAI-style errors: every failure is JSON `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# The `type` OpenAI clients see for each status; `code` carries the specific reason.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "aborted",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


def error_type_for(status_code: int) -> str:
    return ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class APIError(Exception):
    """A refusal with its HTTP status; raised anywhere, answered by `install_error_handlers`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
        details: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        # Fields beside OpenAI's four in the `error` object (clients that do not know them ignore them).
        self.details = details or {}
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or error_type_for(status_code)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.error_type, param=self.param, code=self.code)
        body = ErrorBody(error=detail).model_dump()
        body["error"].update(self.details)
        return body

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class BodyTooLarge(APIError):
    def __init__(self, limit_bytes: int):
        super().__init__(413, f"request body exceeds the {limit_bytes} byte limit", code="body_too_large")
        self.limit_bytes = limit_bytes


class BodyReadTimeout(APIError):
    def __init__(self, timeout_s: float):
        super().__init__(
            408,
            f"the request body was not received within {timeout_s:g} s",
            code="body_read_timeout",
            headers={"Connection": "close"},
        )


class ClientDisconnected(APIError):
    """The client went away before the answer was ready (nginx's 499; nobody reads the body)."""

    def __init__(self) -> None:
        super().__init__(499, "client disconnected")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A one-line message naming the offending field, and that field as `param`, from pydantic errors."""
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return (f"{param}: {message}" if param else message), param


def invalid_value(errors: list[dict[str, Any]]) -> APIError:
    message, param = validation_message(errors)
    return APIError(400, message, param=param, code="invalid_value")


async def _answer_api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _answer_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return invalid_value(list(exc.errors())).response()


async def _answer_http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()


def request_id_of(request: Request) -> str | None:
    """The request's x-request-id when a middleware assigned one (the gateway's RequestId)."""
    state = request.scope.get("state") or {}
    value = state.get("request_id") if isinstance(state, dict) else None
    return value if isinstance(value, str) else None


def generic_server_error(
    status_code: int, request_id: str | None, code: str | None = None, headers: dict[str, str] | None = None
) -> APIError:
    """A 5xx a client may see: what kind of failure, and the id to quote; never exception text or
    internal addresses (those go to the log under the same id)."""
    what = {
        502: "the model backend failed",
        503: "the service is unavailable; retry later",
        504: "the model backend timed out",
    }.get(status_code, "internal error")
    suffix = f" (request id {request_id})" if request_id else ""
    return APIError(status_code, what + suffix, code=code, headers=headers)


async def _answer_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # A bug, not bad input: log it fully (with the request id), answer in the same JSON shape.
    request_id = request_id_of(request)
    logger.exception("unhandled error on %s %s (request id %s)", request.method, request.url.path, request_id)
    return generic_server_error(500, request_id, code="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure, including routing (404/405) and bugs (500), in the OpenAI error shape."""
    app.add_exception_handler(APIError, _answer_api_error)
    app.add_exception_handler(RequestValidationError, _answer_validation_error)
    app.add_exception_handler(StarletteHTTPException, _answer_http_error)
    app.add_exception_handler(Exception, _answer_unexpected)
