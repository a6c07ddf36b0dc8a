"""The key forms' fields as the keys file's types: each bad field is a `FieldError` naming it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime

from pydantic import ValidationError

from ctxgate.gateway.keys import NAME_PATTERN, Limits
from ctxgate.gateway.keys_cli import parse_duration, parse_when
from ctxgate.gateway.keys_limit_flags import MAX_LIMIT

# The form's limit inputs: every field of `Limits` but the per-model table (a nested mapping).
LIMIT_FIELDS = tuple(name for name in Limits.model_fields if name != "models")
# Limits spelled as words, which `Limits` checks itself; every other limit is a number.
_WORD_FIELDS = ("budget_period", "window", "time_zone")
_KEY_ID = re.compile(r"^[0-9a-f]{8,64}$")
_TENANT = re.compile(NAME_PATTERN)
_MODEL = re.compile(r"^[A-Za-z0-9_.:/-]{1,128}$")


class FieldError(ValueError):
    def __init__(self, field: str, reason: str):
        super().__init__(f"field '{field}': {reason}")
        self.field = field


@dataclass(frozen=True)
class NewKey:
    tenant: str
    policy: str | None
    models: list[str] | None
    expires_at: datetime | None
    limits: Limits


def _given(form: dict[str, str], name: str) -> str | None:
    value = form.get(name, "").strip()
    return value or None


def limits_from(form: dict[str, str]) -> Limits:
    values: dict[str, str] = {}
    for name in LIMIT_FIELDS:
        value = _given(form, name)
        if value is None:
            continue
        if name not in _WORD_FIELDS:
            try:
                number = float(value)
            except ValueError:
                raise FieldError(name, f"'{value[:40]}' is not a number") from None
            if not math.isfinite(number) or abs(number) > MAX_LIMIT:
                raise FieldError(name, f"must be a finite number up to {MAX_LIMIT:g}")
        values[name] = value
    if "budget_period" in values and "budget" not in values:
        raise FieldError("budget_period", "needs a budget")
    try:
        return Limits.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise FieldError(".".join(str(part) for part in first["loc"]), first["msg"]) from None


def key_id_from(form: dict[str, str]) -> str:
    key_id = form.get("key_id", "").strip().lower()
    if not _KEY_ID.match(key_id):
        raise FieldError("key_id", "give a key id (8 to 64 hex digits) as listed")
    return key_id


def grace_from(form: dict[str, str]) -> float:
    grace = _given(form, "grace")
    if grace is None:
        return 0.0
    try:
        return parse_duration(grace)
    except ValueError as exc:
        raise FieldError("grace", str(exc)) from None


def new_key_from(form: dict[str, str]) -> NewKey:
    tenant = form.get("tenant", "").strip()
    if not 1 <= len(tenant) <= 64 or not _TENANT.match(tenant):
        raise FieldError("tenant", "1 to 64 letters, digits, '.', '_' or '-'")
    policy = _given(form, "policy")
    if policy is not None and (len(policy) > 64 or not _TENANT.match(policy)):
        raise FieldError("policy", "a policy name: letters, digits, '.', '_' or '-'")
    models = [name.strip() for name in (form.get("models") or "").split(",") if name.strip()] or None
    for name in models or []:
        if not _MODEL.match(name):
            raise FieldError("models", f"'{name[:40]}' is not a model name")
    expires = _given(form, "expires")
    try:
        expires_at = parse_when(expires) if expires else None
    except ValueError as exc:
        raise FieldError("expires", str(exc).removeprefix("--expires: ")) from None
    return NewKey(tenant, policy, models, expires_at, limits_from(form))
