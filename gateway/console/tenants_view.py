"""Tenants and their keys as the console lists them: masked key ids, status, expiry, what each may
use, and the tenant's usage in its current quota windows against its limits, with when each resets.

An adapter over today's interfaces: the keys file (`ctxgate.gateway.keys`), the tenant's limits as
the gateway computes them (`Accounting.limits_for`) and the ledger's `usage` (`QuotaStore`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ctxgate.gateway.keys import KeyEntry, KeysFile, Tenant, TenantEntry, read_keys_file, utc_text
from ctxgate.gateway.quota import LimitUsage, StoreUnavailable
from ctxgate.gateway.service import Gateway

MASK_DIGITS = 8  # of the 12-digit key id: enough to tell keys apart on a screen


@dataclass(frozen=True)
class KeyRow:
    key_id: str  # the 12-digit id the forms post (a hash prefix, not the secret)
    masked_id: str
    status: str
    created: str | None
    expires_at: str | None
    models: tuple[str, ...] | None
    limits: dict[str, Any]
    labels: dict[str, str]


@dataclass(frozen=True)
class UsageRow:
    name: str
    used: float
    limit: float | None
    resets_in_s: int
    resets_at: str  # ISO 8601 in the limit's time zone


@dataclass(frozen=True)
class TenantRow:
    name: str
    policy: str
    policies: tuple[str, ...]
    indexes: tuple[str, ...]
    keys: list[KeyRow]
    usage: list[UsageRow]
    problem: str | None  # why usage is missing (home policy not loaded, ledger unreachable)


@dataclass(frozen=True)
class TenantsView:
    configured: bool  # a keys file is set
    tenants: list[TenantRow]
    reload_error: str | None


def mask(key_id: str) -> str:
    return key_id[:MASK_DIGITS] + "…"


def key_row(entry: KeyEntry, now: datetime) -> KeyRow:
    return KeyRow(
        key_id=entry.key_id,
        masked_id=mask(entry.key_id),
        status=entry.status(now),
        created=entry.created,
        expires_at=utc_text(entry.expires_at) if entry.expires_at else None,
        models=tuple(entry.models) if entry.models else None,
        limits=entry.limits.model_dump(exclude_none=True),
        labels=dict(entry.labels),
    )


def tenant_of(name: str, entry: TenantEntry) -> Tenant:
    """The tenant as the gateway resolves it for one of its keys (limits and allow-lists)."""
    return Tenant(
        name=name,
        policy=entry.policy,
        quota_override=entry.quota.model_dump(exclude_none=True) or None,
        policies=tuple(entry.policies or ()),
        indexes=tuple(entry.indexes or ()),
    )


def usage_rows(usage: tuple[LimitUsage, ...]) -> list[UsageRow]:
    """One row per limit the ledger checks for the tenant (every window and budget, per model too)."""
    rows = []
    for limit in usage:
        shown = limit.report()
        name = limit.name.replace("_", " ")
        if limit.model:
            name += f" ({limit.model})"
        rows.append(UsageRow(name, shown["used"], shown["max"], limit.reset_s, limit.resets_at))
    return rows


async def tenant_row(gateway: Gateway, name: str, entry: TenantEntry, now: datetime) -> TenantRow:
    tenant = tenant_of(name, entry)
    home_name = gateway.access.home_policy_name(tenant)
    keys = [key_row(key, now) for key in entry.keys]
    common: dict[str, Any] = {
        "name": name,
        "policy": home_name,
        "policies": tuple(gateway.access.allowed_policies(tenant) or ()),
        "indexes": tenant.indexes or (),
        "keys": keys,
    }
    home = gateway.policies.get(home_name)
    if home is None:
        return TenantRow(**common, usage=[], problem=f"home policy '{home_name}' is not loaded")
    limits = gateway.accounting.limits_for(tenant, home)
    try:
        usage = await gateway.store.usage(name, limits, now.timestamp())
    except StoreUnavailable:
        return TenantRow(**common, usage=[], problem="the quota ledger is unreachable")
    return TenantRow(**common, usage=usage_rows(usage), problem=None)


async def tenants_view(gateway: Gateway, keys_file: Path | None, now: datetime) -> TenantsView:
    if keys_file is None:
        return TenantsView(False, [], None)
    try:
        parsed = await asyncio.to_thread(read_keys_file, keys_file)
    except ValueError as exc:
        return TenantsView(True, [], str(exc))
    return TenantsView(True, await _rows(gateway, parsed, now), gateway.keys.last_error)


async def _rows(gateway: Gateway, parsed: KeysFile, now: datetime) -> list[TenantRow]:
    return [await tenant_row(gateway, name, entry, now) for name, entry in sorted(parsed.tenants.items())]
