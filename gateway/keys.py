"""API keys and tenants: a YAML file mapping sha256-hashed keys to a tenant, its policy and quotas.

Only hashes are stored, so a leaked keys file does not leak credentials. File layout:

    tenants:
      acme:
        policy: rag-strict             # optional; default policy otherwise
        quota: {tokens_per_minute: 5000} # optional; overrides the policy's quota fields
        keys:
          - {sha256: 3f2a..., created: "2026-01-01T00:00:00Z"}
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

ANONYMOUS_TENANT = "anonymous"
KEY_PREFIX = "cg-"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KeyEntry(_Strict):
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    created: str | None = None
    label: str | None = None


class QuotaOverride(_Strict):
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    tokens_per_day: int | None = Field(None, ge=1)
    spend_per_day: float | None = Field(None, gt=0)
    on_store_error: str | None = Field(None, pattern="^(allow|deny)$")


class TenantEntry(_Strict):
    policy: str | None = None
    quota: QuotaOverride = QuotaOverride()
    keys: list[KeyEntry] = Field(default_factory=list)


class KeysFile(_Strict):
    tenants: dict[str, TenantEntry] = Field(default_factory=dict)


@dataclass(frozen=True)
class Tenant:
    name: str
    policy: str | None = None
    quota_override: dict[str, Any] | None = None


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


def add_key(path: str | Path, tenant: str, policy: str | None = None, label: str | None = None) -> str:
    """Create a key for `tenant`, store only its hash in the file, and return the key (shown once)."""
    path = Path(path)
    keys_file = read_keys_file(path)
    entry = keys_file.tenants.setdefault(tenant, TenantEntry())
    if policy:
        entry.policy = policy
    api_key = generate_key()
    created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    entry.keys.append(KeyEntry(sha256=hash_key(api_key), created=created, label=label))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(keys_file.model_dump(exclude_none=True), sort_keys=False), encoding="utf-8")
    tmp.replace(path)  # atomic, so a running gateway never reads half a file
    return api_key


class KeyStore:
    """Resolves bearer keys to tenants; re-reads the file when it changes (polled by the gateway)."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self._by_hash: dict[str, Tenant] = {}
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
        for name, entry in keys_file.tenants.items():
            override = entry.quota.model_dump(exclude_none=True) or None
            tenant = Tenant(name=name, policy=entry.policy, quota_override=override)
            for key in entry.keys:
                by_hash[key.sha256] = tenant
        with self._lock:
            self._by_hash = by_hash
            self._signature = signature
            self.last_error = None
        return True

    def resolve(self, api_key: str | None) -> Tenant | None:
        """The tenant for this key, ANONYMOUS in open mode, or None for a missing/unknown key."""
        if self.path is None:
            return ANONYMOUS
        if not api_key:
            return None
        digest = hash_key(api_key)
        # Looking up the digest (not the key) means timing reveals nothing an attacker controls.
        with self._lock:
            return self._by_hash.get(digest)
