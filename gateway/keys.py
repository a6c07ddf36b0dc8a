"""API keys and tenants: a YAML file mapping sha256-hashed keys to a tenant, its policy and quotas.

Only hashes are stored, so a leaked keys file does not leak credentials. File layout:

    tenants:
      acme:
        policy: rag-strict             # optional: the tenant's home policy; the server's default otherwise
        policies: [rag-strict, rag-fast] # optional: policies its requests may name (`ctxgate.policy`);
                                         # the home policy always counts; default: the home policy only
        indexes: [acme-docs]           # optional: retrieval indexes it may search; default: none
        quota: {tokens_per_minute: 5000} # optional; overrides the home policy's quota fields
        weight: 2                      # optional: its share of the engine's prefill and of admission
                                       # under overload, against other tenants' weights (default 1)
        keys:
          - sha256: 3f2a...
            created: "2026-01-01T00:00:00Z"
            expires_at: "2026-06-30T00:00:00Z"        # optional; afterwards the key gets 401
            revoked_at: "2026-02-01T10:00:00Z"        # set by `ctxgate keys revoke`
            limits: {requests_per_minute: 60, max_parallel_requests: 4, budget: 20, budget_period: monthly}
            # limits may hold `models: {big: {tokens_per_minute: 1000}}`: limits for one model, on top
            models: [smollm2-135m]                    # optional allow-list of served model names
            labels: {team: search, env: prod}

A key's limits apply on top of its tenant's (both must have room), and the limits either holds for
the requested model (`models: {NAME: {...}}`, names the key may use) on top of those. The key's id is the first 12
hex digits of its hash; `quota_id` keeps a rotated key on its predecessor's counters.

Quotas and prices belong to the tenant, whatever policy a request names: the tenant's limits are its
`quota` over its home policy's quota, and a requested policy's quota can only tighten them (per
field, the smaller limit wins; `on_store_error: deny` wins over allow). Prices are the home policy's
`cost`; a requested policy in the same currency can only raise a price. Naming a policy outside
`policies` is a 403 (`policy_not_allowed`); naming an index outside `indexes` is a 404 that reads
the same as an index that does not exist. Without a keys file (open mode) every policy and index
may be used.

The writers (`ctxgate keys add|revoke|rotate`) are in `ctxgate.gateway.key_admin`.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ctxgate.backend.engine.api import MAX_TENANT_WEIGHT
from ctxgate.compression.store.index_names import INDEX_NAME_PATTERN
from ctxgate.policies.schema import TimeZone

ANONYMOUS_TENANT = "anonymous"
KEY_PREFIX = "cg-"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


KEY_ID_LENGTH = 12


class _Counts(_Strict):
    requests_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="requests per minute (any 60 seconds, unless window: fixed); beyond: 429",
    )
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="prompt + completion tokens per minute"
    )
    tokens_per_day: int | None = Field(default=None, ge=1, description="prompt + completion tokens per day")
    tokens_per_week: int | None = Field(
        default=None, ge=1, description="prompt + completion tokens per calendar week (from Monday)"
    )
    tokens_per_month: int | None = Field(
        default=None, ge=1, description="prompt + completion tokens per calendar month"
    )
    spend_per_day: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="spend per day, at the home policy's prices"
    )
    max_parallel_requests: int | None = Field(default=None, ge=1, description="requests in flight at once")
    # Finite: `.inf` would read as a limit and never bind.
    budget: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="spend allowed per budget_period (policy cost units)",
    )
    budget_period: Literal["daily", "weekly", "monthly"] | None = Field(
        default=None,
        description="when the budget starts again (calendar days, weeks from Monday and months, in time_zone)",
    )


class ModelLimits(_Counts):
    """Limits for one served model, on top of the key's or tenant's own (window and zone are theirs)."""


class Limits(_Counts):
    """Limits of a tenant (overriding its policy's quota) or of one key (on top of the tenant's)."""

    window: Literal["sliding", "fixed"] | None = Field(
        default=None,
        description="the per-minute limits: sliding (any 60 seconds) or fixed (calendar minutes); "
        "null: the tenant's (a key's), the policy's (a tenant's)",
    )
    time_zone: TimeZone | None = Field(
        default=None,
        description="IANA zone where days, weeks and months begin; null: the tenant's (a key's), the "
        "policy's (a tenant's)",
    )
    models: dict[str, ModelLimits] | None = Field(
        default=None,
        description="limits per served model name, enforced on top of these; a key may name only "
        "models it may use",
    )


class QuotaOverride(Limits):
    on_store_error: str | None = Field(
        default=None,
        pattern="^(allow|deny)$",
        description="allow or deny requests while "
        "the quota ledger cannot be reached; deny wins over the policy's allow",
    )


class KeyEntry(_Strict):
    sha256: str = Field(
        default=...,
        pattern=r"^[0-9a-f]{64}$",
        description="the key's sha256 (hex): the key itself is "
        "never stored; its first 12 digits are the key id",
    )
    created: str | None = Field(default=None, description="when `keys add` created the key (ISO 8601)")
    label: str | None = None  # a free-text note (older files); `labels` are searchable key/value pairs
    labels: dict[str, str] = Field(
        default_factory=dict, description="key/value pairs `keys list --label` filters by"
    )
    expires_at: datetime | None = Field(default=None, description="from then on the key gets 401")
    revoked_at: datetime | None = Field(default=None, description="set by `keys revoke`: the key gets 401")
    limits: Limits = Field(default=Limits(), description="this key's own limits, on top of its tenant's")
    models: list[str] | None = Field(
        default=None, min_length=1, description="served model names this key may use"
    )
    quota_id: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{12}$",
        description="the ledger identity of the key's "
        "limits: a rotated key keeps its predecessor's, and so its counters",
    )

    @model_validator(mode="after")
    def _limits_name_usable_models(self) -> KeyEntry:
        # A limit for a model the key may not use would never apply: a typo, said at load time.
        if self.models is None:  # every model may be used
            return self
        unusable = sorted(set(self.limits.models or {}) - set(self.models))
        if unusable:
            raise ValueError(
                f"limits.models names {', '.join(unusable)}, which this key may not use (models: "
                f"{', '.join(self.models)})"
            )
        return self

    @property
    def key_id(self) -> str:
        return self.sha256[:KEY_ID_LENGTH]

    def status(self, now: datetime) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and aware(self.expires_at) <= now:
            return "expired"
        return "active"


NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"  # a policy name (policies/schema.py)


class TenantEntry(_Strict):
    policy: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="the tenant's home policy; null: the server's default_policy",
    )
    policies: list[Annotated[str, Field(pattern=NAME_PATTERN)]] | None = Field(
        default=None, description="policies this tenant's requests may name (its home policy always)"
    )
    indexes: list[Annotated[str, Field(pattern=INDEX_NAME_PATTERN)]] | None = Field(
        default=None, description="retrieval indexes this tenant may search (default: none)"
    )
    quota: QuotaOverride = Field(
        default=QuotaOverride(),
        description="the tenant's limits, overriding its policy's quota "
        "field by field (the smaller limit wins)",
    )
    weight: float = Field(
        default=1.0,
        gt=0,
        le=MAX_TENANT_WEIGHT,
        description="the tenant's share against other tenants' weights: of the built-in engine's prefill "
        "tokens (fair queuing) and of the admission queue when the gateway sheds load",
    )
    keys: list[KeyEntry] = Field(default_factory=list, description="the tenant's API keys, as their hashes")

    @model_validator(mode="after")
    def _quota_names_usable_models(self) -> TenantEntry:
        # Where every key has an allow-list, a model none of them may use can never be limited.
        named = set(self.quota.models or {})
        if not named or not self.keys or any(key.models is None for key in self.keys):
            return self
        usable = {model for key in self.keys for model in key.models or ()}
        if named - usable:
            raise ValueError(
                f"quota.models names {', '.join(sorted(named - usable))}, which none of the tenant's keys "
                f"may use (their models: {', '.join(sorted(usable))})"
            )
        return self


class KeysFile(_Strict):
    tenants: dict[str, TenantEntry] = Field(
        default_factory=dict, description="tenant name -> its policy, limits and keys"
    )


@dataclass(frozen=True)
class KeyInfo:
    """What the gateway needs to know about the key a request came with."""

    key_id: str
    quota_id: str  # the ledger identity of its per-key limits (survives rotation)
    limits: dict[str, Any] | None = None
    models: tuple[str, ...] | None = None
    labels: dict[str, str] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Tenant:
    name: str
    policy: str | None = None
    quota_override: dict[str, Any] | None = None
    key: KeyInfo | None = None
    # None: anything goes (open mode). A tuple: the keys file's allow-list (policies: the home policy
    # is added by the gateway, which knows the default; an empty tuple means the home policy only).
    policies: tuple[str, ...] | None = None
    indexes: tuple[str, ...] | None = None
    weight: float = 1.0  # the keys file's: its fair share of the engine and of admission

    @property
    def bounded(self) -> bool:
        """A keys-file tenant: held to its allow-lists, its quota and its prices (not open mode)."""
        return self.policies is not None


class KeyRejected(Exception):
    """A known key that may not be used (revoked or expired); the message says which and since when."""


def aware(moment: datetime) -> datetime:
    # Timestamps without a zone in a hand-edited file are taken as UTC.
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def utc_text(moment: datetime) -> str:
    return aware(moment).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


ANONYMOUS = Tenant(ANONYMOUS_TENANT)


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def read_keys_file(path: str | Path) -> KeysFile:
    path = Path(path)
    if not path.exists():
        return KeysFile()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        return KeysFile.model_validate(data)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{path}: field '{loc}': {first['msg']}") from None


class KeyStore:
    """Resolves bearer keys to tenants; re-reads the file when it changes (polled by the gateway)."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self._by_hash: dict[str, Tenant] = {}
        self._entries: dict[str, KeyEntry] = {}
        self._signature: str | None = None
        self._lock = threading.Lock()
        self.last_error: str | None = None
        if self.path is not None:
            if not self.path.exists():
                raise FileNotFoundError(f"keys file not found: {self.path}")
            self.refresh(raise_errors=True)

    def refresh(self, raise_errors: bool = False) -> bool:
        if self.path is None:
            return False
        try:
            content = self.path.read_bytes()
        except OSError as exc:
            self.last_error = f"{self.path}: {exc}"
            return False
        signature = hashlib.sha256(content).hexdigest()
        if signature == self._signature:
            return False
        try:
            keys_file = read_keys_file(self.path)
        except ValueError as exc:
            self.last_error = str(exc)
            self._signature = signature
            if raise_errors:
                raise
            return False
        by_hash: dict[str, Tenant] = {}
        entries: dict[str, KeyEntry] = {}
        for name, entry in keys_file.tenants.items():
            override = entry.quota.model_dump(exclude_none=True) or None
            for key in entry.keys:
                info = KeyInfo(
                    key_id=key.key_id,
                    quota_id=key.quota_id or key.key_id,
                    limits=key.limits.model_dump(exclude_none=True) or None,
                    models=tuple(key.models) if key.models else None,
                    labels=dict(key.labels),
                )
                by_hash[key.sha256] = Tenant(
                    name=name,
                    policy=entry.policy,
                    quota_override=override,
                    key=info,
                    policies=tuple(entry.policies or ()),
                    indexes=tuple(entry.indexes or ()),
                    weight=entry.weight,
                )
                entries[key.sha256] = key
        with self._lock:
            self._by_hash = by_hash
            self._entries = entries
            self._signature = signature
            self.last_error = None
        return True

    def counts(self) -> tuple[int, int]:
        """(tenants, keys) currently loaded: what the startup banner reports."""
        with self._lock:
            tenants = {tenant.name for tenant in self._by_hash.values()}
            return len(tenants), len(self._by_hash)

    def resolve(self, api_key: str | None) -> Tenant | None:
        """The tenant for this key, ANONYMOUS in open mode, or None for a missing/unknown key."""
        if self.path is None:
            return ANONYMOUS
        if not api_key:
            return None
        try:
            return self.authenticate(api_key)
        except KeyRejected:
            return None

    def authenticate(self, api_key: str | None, now: datetime | None = None) -> Tenant | None:
        """Like `resolve`, but a revoked or expired key raises KeyRejected saying why."""
        if self.path is None:
            return ANONYMOUS
        if not api_key:
            return None
        digest = hash_key(api_key)
        # Looking up the digest (not the key) means timing reveals nothing an attacker controls.
        with self._lock:
            tenant = self._by_hash.get(digest)
            entry = self._entries.get(digest)
        if tenant is None or entry is None:
            return None
        status = entry.status(now or datetime.now(UTC))
        if status == "revoked":
            raise KeyRejected(f"API key {entry.key_id} was revoked at {utc_text(entry.revoked_at)}")
        if status == "expired":
            raise KeyRejected(f"API key {entry.key_id} expired at {utc_text(entry.expires_at)}")
        return tenant
