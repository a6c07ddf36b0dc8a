"""The console's actions: create, revoke and rotate keys, change a key's limits, save a policy edit.

Keys are written through the CLI's own locked, atomic keys-file code (`ctxgate.gateway.key_admin`),
then this replica reloads the file at once (others within their reload interval). Every action,
done or refused, writes one audit line with the request id.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from ctxgate.gateway.console.audit import audit
from ctxgate.gateway.console.guard import action_form, console_of, error_page, gateway_of
from ctxgate.gateway.console.key_forms import FieldError, grace_from, key_id_from, limits_from, new_key_from
from ctxgate.gateway.console.policies_view import editable_files
from ctxgate.gateway.console.policy_edit import PolicyEditError, save_policy, target_file
from ctxgate.gateway.console.session import Session
from ctxgate.gateway.key_admin import add_key, revoke_key, rotate_key, set_key_limits
from ctxgate.gateway.keys import hash_key

router = APIRouter(prefix="/console", include_in_schema=False)


def _done(
    request: Request, session: Session, message: str, secret: str | None = None, back: str = "/console"
):
    return console_of(request).templates.render(
        "message.html", title="Done", message=message, kind="ok", secret=secret, back=back, session=session
    )


def _keys_file(request: Request) -> Path:
    path = gateway_of(request).settings.keys_file
    if path is None:
        raise FieldError("keys_file", "no keys file is configured (server.keys_file)")
    return path


async def _reload_keys(request: Request) -> None:
    await asyncio.to_thread(gateway_of(request).keys.refresh)


def _refused(request: Request, session: Session, action: str, target: str, exc: Exception) -> Response:
    audit(action, target, "refused", type(exc).__name__)
    status = 409 if isinstance(exc, FieldError) and exc.field == "keys_file" else 400
    return error_page(request, status, str(exc), session)


@router.post("/keys/create")
async def create_key(request: Request) -> Response:
    session, form = await action_form(request)
    target = "tenant:" + form.get("tenant", "")[:64]
    try:
        path = _keys_file(request)
        new = new_key_from(form)
        policies = gateway_of(request).policies
        if new.policy is not None and policies.get(new.policy) is None:
            raise FieldError("policy", f"no policy '{new.policy}' is loaded")
        key = await asyncio.to_thread(
            add_key,
            path,
            new.tenant,
            new.policy,
            expires_at=new.expires_at,
            limits=new.limits,
            models=new.models,
        )
    except ValueError as exc:
        return _refused(request, session, "key.create", target, exc)
    await _reload_keys(request)
    audit("key.create", target, "ok", f"key:{_id_of(key)}")
    return _done(request, session, f"Created a key for tenant '{new.tenant}'.", secret=key)


def _id_of(key: str) -> str:
    return hash_key(key)[:12]


@router.post("/keys/revoke")
async def revoke(request: Request) -> Response:
    session, form = await action_form(request)
    try:
        path = _keys_file(request)
        key_id = key_id_from(form)
        tenant, entry = await asyncio.to_thread(revoke_key, path, key_id)
    except ValueError as exc:
        return _refused(request, session, "key.revoke", "key:" + form.get("key_id", "")[:64], exc)
    await _reload_keys(request)
    audit("key.revoke", f"key:{entry.key_id}", "ok", f"tenant:{tenant}")
    return _done(request, session, f"Revoked key {entry.key_id[:8]}… of tenant '{tenant}'.")


@router.post("/keys/rotate")
async def rotate(request: Request) -> Response:
    session, form = await action_form(request)
    try:
        path = _keys_file(request)
        key_id = key_id_from(form)
        grace = grace_from(form)
        tenant, key, old = await asyncio.to_thread(rotate_key, path, key_id, grace)
    except ValueError as exc:
        return _refused(request, session, "key.rotate", "key:" + form.get("key_id", "")[:64], exc)
    await _reload_keys(request)
    audit("key.rotate", f"key:{old.key_id}", "ok", f"new_key:{_id_of(key)}")
    return _done(
        request,
        session,
        f"Rotated key {old.key_id[:8]}… of tenant '{tenant}'; the old key no longer works.",
        key,
    )


@router.post("/keys/limits")
async def change_limits(request: Request) -> Response:
    session, form = await action_form(request)
    try:
        path = _keys_file(request)
        key_id = key_id_from(form)
        limits = limits_from(form)
        tenant, entry = await asyncio.to_thread(set_key_limits, path, key_id, limits)
    except ValueError as exc:
        return _refused(request, session, "key.limits", "key:" + form.get("key_id", "")[:64], exc)
    await _reload_keys(request)
    audit("key.limits", f"key:{entry.key_id}", "ok", f"tenant:{tenant}")
    return _done(request, session, f"Saved the limits of key {entry.key_id[:8]}… of tenant '{tenant}'.")


@router.post("/policies/save")
async def save_policy_edit(request: Request) -> Response:
    session, form = await action_form(request)
    gateway = gateway_of(request)
    # A textarea posts CRLF line ends: the file keeps the Unix ones the other policy files have.
    file, text = form.get("file", ""), form.get("text", "").replace("\r\n", "\n")
    policy_dir = gateway.settings.policy_dir
    try:
        target = target_file(policy_dir, file, editable_files(policy_dir))
        saved = await asyncio.to_thread(save_policy, target, text, gateway.policies)
    except PolicyEditError as exc:
        audit("policy.save", f"file:{file[:64]}", "refused", "invalid")
        return console_of(request).templates.render(
            "policy_edit.html",
            status=400,
            title=f"Edit {file[:64]}",
            active="policies",
            session=session,
            file=file,
            text=text,
            error=str(exc),
        )
    if await asyncio.to_thread(gateway.policies.refresh):
        gateway.metrics.policies_loaded.set(len(gateway.policies.names()))
    audit("policy.save", f"file:{saved.file}", "ok", f"policy:{saved.name}")
    return _done(
        request,
        session,
        f"Saved {saved.file} (policy '{saved.name}'); it is in force now.",
        back="/console/policies",
    )
