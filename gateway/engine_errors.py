"""What a client is told when a generation fails. A 4xx from the engine is about the request and keeps
its message; a 5xx says only what kind of failure and the request id, while the log gets the details
(an upstream's URL, its error text) under that id."""

from __future__ import annotations

import logging

from ctxgate.backend.engine.api import EngineError
from ctxgate.backend.openai_api.errors import APIError, generic_server_error
from ctxgate.backend.routing.upstream import UpstreamRefused
from ctxgate.gateway.metrics import GatewayMetrics
from ctxgate.gateway.request_id import current_request

logger = logging.getLogger(__name__)


def engine_error(exc: Exception, metrics: GatewayMetrics) -> APIError:
    """The client's answer for a failed generation (counted in `upstream_errors` by status)."""
    context = current_request()
    request_id = context.request_id if context is not None else None
    if isinstance(exc, EngineError):
        metrics.upstream_errors.labels(str(exc.status_code)).inc()
        # An engine refusing for load is the documented overload answer: tell clients when to retry.
        retry = {"Retry-After": "1"} if exc.status_code in (429, 503) else None
        code = "overloaded" if retry else (exc.code or "engine_error")
        if isinstance(exc, UpstreamRefused):
            # The upstream's words (a traceback, a path, an internal URL) are for the log only.
            logger.warning("model backend refused (request id %s): %s", request_id, exc.detail)
            return APIError(
                exc.status_code, f"{exc} (request id {request_id})", param=exc.param, code=code, headers=retry
            )
        if exc.status_code < 500:
            return APIError(exc.status_code, str(exc), param=exc.param, code=code, headers=retry)
        logger.warning("model backend answered %d (request id %s): %s", exc.status_code, request_id, exc)
        return generic_server_error(exc.status_code, request_id, code=code, headers=retry)
    if isinstance(exc, TimeoutError):
        metrics.upstream_errors.labels("504").inc()
        logger.warning("request timed out (request id %s): %s", request_id, exc)
        return generic_server_error(504, request_id, code="timeout")
    metrics.upstream_errors.labels("502").inc()
    logger.error("model backend failed (request id %s)", request_id, exc_info=exc)
    return generic_server_error(502, request_id, code="upstream_error")
