"""What a key has used of each limit it meets, and when each resets: `ctxgate keys show` reads the
shared ledger (Redis) the way a gateway would reserve against it.

The limits are the gateway's for a request under the tenant's home policy: the tenant's keys-file
`quota` over that policy's quota (the policy as `--config` serves it; without one, the packaged
policies), the key's own limits on top, and either's limits per model for every model they name.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from ctxgate.gateway.keys import KeyEntry, TenantEntry
from ctxgate.gateway.quota import LimitUsage, QuotaLimits, QuotaStore
from ctxgate.policies.schema import QuotaPolicy


@dataclass(frozen=True)
class KeyScopes:
    """The limits one key's requests meet, and the ledger ids they are counted under."""

    tenant: str
    limits: QuotaLimits
    key_id: str | None
    key_limits: QuotaLimits | None

    @classmethod
    def of(cls, tenant: str, entry: TenantEntry, key: KeyEntry, home_quota: QuotaPolicy) -> KeyScopes:
        limits = QuotaLimits.from_policy(home_quota, entry.quota.model_dump(exclude_none=True) or None)
        own = key.limits.model_dump(exclude_none=True)
        if not own:
            return cls(tenant, limits, None, None)
        return cls(tenant, limits, key.quota_id or key.key_id, QuotaLimits.from_mapping(own, inherit=limits))

    def models(self) -> list[str]:
        named = set(self.limits.models) | set(self.key_limits.models if self.key_limits else {})
        return sorted(named)


async def key_usage(store: QuotaStore, scopes: KeyScopes, now: float | None = None) -> list[LimitUsage]:
    """Every limit the key's requests meet (its tenant's included), as used at `now`."""
    now = time.time() if now is None else now
    found: dict[tuple[str, str, str | None], LimitUsage] = {}
    for model in [None, *scopes.models()]:
        for usage in await store.usage(
            scopes.tenant, scopes.limits, now, key_id=scopes.key_id, key_limits=scopes.key_limits, model=model
        ):
            found[(usage.name, usage.owner, usage.model)] = usage
    return list(found.values())


def home_quota(policy: str | None, config_path: str | None) -> QuotaPolicy:
    """The quota of the tenant's home policy as `ctxgate serve --config FILE` loads it (the packaged
    policies, then the file's policy_dir); `policy` None: the file's default policy."""
    from pathlib import Path

    from ctxgate.gateway.config_file import CtxgateConfig, load_config
    from ctxgate.policies.loader import PolicyRegistry, packaged_policy_dir

    server = (load_config(config_path) if config_path else CtxgateConfig()).server
    directories = [packaged_policy_dir()] if server.include_packaged_policies else []
    if server.policy_dir is not None:
        directories.append(Path(server.policy_dir))
    name = policy or server.default_policy
    loaded = PolicyRegistry(directories).get(name)
    if loaded is None:
        raise ValueError(f"policy '{name}' is not among the policies {config_path or 'ctxgate ships'} serves")
    return loaded.quota


def read_key_usage(
    redis_url: str, config_path: str | None, tenant: str, entry: TenantEntry, key: KeyEntry
) -> list[dict[str, Any]]:
    """`key_usage` from the Redis ledger at `redis_url`, as JSON-ready reports."""
    from ctxgate.gateway.quota import RedisQuotaStore

    scopes = KeyScopes.of(tenant, entry, key, home_quota(entry.policy, config_path))

    async def read() -> list[dict[str, Any]]:
        store = RedisQuotaStore(redis_url)
        try:
            return [usage.report() for usage in await key_usage(store, scopes)]
        finally:
            await store.close()

    return asyncio.run(read())


def usage_text(usage: dict[str, Any]) -> str:
    """One limit's report in a line: `key.tokens_per_month[big]=120/1000 resets 2026-12-01T00:00:00-05:00`."""
    model = f"[{usage['model']}]" if usage["model"] else ""
    return f"{usage['scope']}.{usage['limit']}{model}={usage['used']:g}/{usage['max']:g} resets {usage['resets_at']}"
