"""ASGI middleware of the gateway's own (body limits, admission and request ids live beside it)."""

from __future__ import annotations

from ctxgate.gateway.metrics import GatewayMetrics

_COUNTED_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/ctxgate/compress",
        "/v1/ctxgate/policies",
    }
)


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
