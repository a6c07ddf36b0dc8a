"""The console's pages (read only) and its login and logout."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response

from ctxgate.gateway.console.audit import audit
from ctxgate.gateway.console.charts import PairedBar, before_after_chart, gauge
from ctxgate.gateway.console.counter_history import RANGES
from ctxgate.gateway.console.engine_view import QUANTILES, engine_view
from ctxgate.gateway.console.forms import FormError, read_form
from ctxgate.gateway.console.guard import (
    action_form,
    console_of,
    current_session,
    error_page,
    gateway_of,
    page_session,
)
from ctxgate.gateway.console.key_forms import LIMIT_FIELDS
from ctxgate.gateway.console.policies_view import editable_files, policies_view
from ctxgate.gateway.console.savings import savings
from ctxgate.gateway.console.session import COOKIE_NAME
from ctxgate.gateway.console.templates import TEMPLATE_DIR
from ctxgate.gateway.console.tenants_view import tenants_view

router = APIRouter(prefix="/console", include_in_schema=False)
STYLESHEET = TEMPLATE_DIR.parent / "static" / "console.css"


@router.get("")
async def tenants_page(request: Request) -> Response:
    session = page_session(request)
    console, gateway = console_of(request), gateway_of(request)
    now = datetime.fromtimestamp(console.clock(), UTC)
    view = await tenants_view(gateway, gateway.settings.keys_file, now)
    return console.templates.render(
        "tenants.html",
        title="Tenants and keys",
        active="tenants",
        session=session,
        view=view,
        limit_fields=LIMIT_FIELDS,
    )


@router.get("/savings")
async def savings_page(request: Request, range: str = "all") -> Response:
    session = page_session(request)
    console, gateway = console_of(request), gateway_of(request)
    if range not in RANGES:
        return error_page(request, 400, f"field 'range': one of {', '.join(RANGES)}", session)
    window = console.history.window(RANGES[range])
    speed = gateway.budgets.load().prefill_tokens_per_s
    figures = savings(window, speed)
    chart = before_after_chart(
        [
            PairedBar(f"{row.tenant} · {row.policy}", row.tokens_before, row.tokens_after)
            for row in figures.rows
        ],
        "prompt tokens before and after compression",
    )
    return console.templates.render(
        "savings.html",
        title="Savings",
        active="savings",
        session=session,
        window=window,
        savings=figures,
        chart=chart,
        ranges=list(RANGES),
        range=range,
        prefill_speed=speed,
    )


@router.get("/policies")
async def policies_page(request: Request) -> Response:
    session = page_session(request)
    gateway = gateway_of(request)
    view = policies_view(gateway.policies, gateway.settings.policy_dir)
    return console_of(request).templates.render(
        "policies.html", title="Policies", active="policies", session=session, view=view
    )


@router.get("/policies/edit")
async def policy_edit_page(request: Request, file: str = "") -> Response:
    session = page_session(request)
    policy_dir = gateway_of(request).settings.policy_dir
    if policy_dir is None or file not in editable_files(policy_dir):
        return error_page(request, 404, "field 'file': not a policy file in the policy directory", session)
    text = await asyncio.to_thread((policy_dir / file).read_text, encoding="utf-8")
    return console_of(request).templates.render(
        "policy_edit.html",
        title=f"Edit {file}",
        active="policies",
        session=session,
        file=file,
        text=text,
        error=None,
    )


@router.get("/engine")
async def engine_page(request: Request) -> Response:
    session = page_session(request)
    gateway = gateway_of(request)
    view = engine_view(gateway.metrics.registry, request.app.state.admission.stats(), gateway.budgets)
    return console_of(request).templates.render(
        "engine.html",
        title="Engine",
        active="engine",
        session=session,
        view=view,
        quantiles=QUANTILES,
        kv_gauge=gauge(view.kv_usage, "KV cache use"),
    )


@router.get("/static/console.css")
async def stylesheet() -> Response:
    return FileResponse(STYLESHEET, media_type="text/css")


@router.get("/login")
async def login_page(request: Request) -> Response:
    if current_session(request) is not None:
        return RedirectResponse("/console", status_code=303)
    return console_of(request).templates.render("login.html", title="Log in", error=None)


@router.post("/login")
async def login(request: Request) -> Response:
    console = console_of(request)
    try:
        form = await read_form(request)
    except FormError as exc:
        return error_page(request, exc.status, exc.message)
    if not console.admin_key.matches(form.get("admin_key")):
        audit("login", "console", "refused")
        return console.templates.render("login.html", status=401, title="Log in", error="Wrong admin key.")
    cookie, session = console.sessions.issue()
    audit("login", "console", "ok")
    response = RedirectResponse("/console", status_code=303)
    response.set_cookie(
        COOKIE_NAME,
        cookie,
        max_age=console.sessions.ttl_s,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    session, _ = await action_form(request)
    console_of(request).sessions.end(session)
    audit("logout", "console", "ok")
    response = RedirectResponse("/console/login", status_code=303)
    response.delete_cookie(COOKIE_NAME, path="/console")
    return response
