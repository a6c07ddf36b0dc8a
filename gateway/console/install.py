"""Mounting the console on the gateway's app: only when an admin key is configured."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from ctxgate.gateway.console import actions, pages
from ctxgate.gateway.console.admin_key import WHERE, AdminKey, AdminKeyError
from ctxgate.gateway.console.counter_history import CounterHistory, read_counters
from ctxgate.gateway.console.guard import Refused
from ctxgate.gateway.console.headers import ConsoleHeaders
from ctxgate.gateway.console.savings import COUNTERS
from ctxgate.gateway.console.session import Sessions
from ctxgate.gateway.console.state import Console
from ctxgate.gateway.console.templates import Templates
from ctxgate.gateway.metrics import GatewayMetrics

SESSION_PURPOSE = "ctxgate console session v1"


async def _refused(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refused)
    return exc.response


def install_console(
    app: FastAPI,
    admin_key: AdminKey,
    metrics: GatewayMetrics,
    clock: Callable[[], float],
    metrics_key: str | None = None,
) -> Console:
    """The console's routes, headers and state on `app` (`app.state.console`); the lifespan samples
    its counters (`Console.sample_forever`)."""
    if admin_key.matches(metrics_key):
        raise AdminKeyError(f"{WHERE}: the admin key must not also be the metrics key")
    console = Console(
        admin_key=admin_key,
        sessions=Sessions(admin_key.derive(SESSION_PURPOSE), clock=clock),
        history=CounterHistory(lambda: read_counters(metrics.registry, COUNTERS), clock=clock),
        templates=Templates(),
        clock=clock,
    )
    app.include_router(pages.router)
    app.include_router(actions.router)
    app.add_exception_handler(Refused, _refused)
    app.add_middleware(ConsoleHeaders)
    app.state.console = console
    return console
