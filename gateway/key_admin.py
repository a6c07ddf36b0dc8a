"""Writing the keys file (`ctxgate.gateway.keys` describes it): `ctxgate keys add|revoke|rotate`.

Writers hold an exclusive lock on `<file>.lock` around their read-modify-write and replace the file
atomically, so concurrent edits never lose one another and a running gateway never reads half a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml
from pydantic import ValidationError

from ctxgate.gateway.keys import (
    KEY_PREFIX,
    KeyEntry,
    KeysFile,
    Limits,
    TenantEntry,
    aware,
    generate_key,
    hash_key,
    read_keys_file,
    utc_text,
)


def write_keys_file(path: str | Path, keys_file: KeysFile) -> None:
    """Replace the file atomically (a running gateway never reads half a file) through a temporary
    file of a unique name, so two writers never share one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = keys_file.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    text = yaml.safe_dump(data, sort_keys=False)
    mode = path.stat().st_mode & 0o777 if path.exists() else _default_mode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fchmod(handle.fileno(), mode)  # mkstemp's 0600 would lock out a gateway of another user
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(path.parent)  # the rename itself survives a crash


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def locked_keys_file(path: str | Path) -> Iterator[KeysFile]:
    """Read the keys file under an exclusive lock held until the block ends: a read-modify-write
    done inside it cannot lose another writer's change. The lock lives on a sibling `.lock` file
    (the keys file itself is replaced, so a lock on it would not be shared)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield read_keys_file(path)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def add_key(
    path: str | Path,
    tenant: str,
    policy: str | None = None,
    label: str | None = None,
    *,
    labels: dict[str, str] | None = None,
    expires_at: datetime | None = None,
    limits: Limits | None = None,
    models: list[str] | None = None,
    quota_id: str | None = None,
    policies: list[str] | None = None,
    indexes: list[str] | None = None,
    weight: float | None = None,
) -> str:
    """Create a key for `tenant`, store only its hash in the file, and return the key (shown once).
    `policies` / `indexes` are added to the tenant's allow-lists; `weight` (when given) becomes the
    tenant's."""
    api_key = generate_key()
    with locked_keys_file(path) as keys_file:
        entry = keys_file.tenants.setdefault(tenant, TenantEntry())
        if policy:
            entry.policy = policy
        if policies:
            entry.policies = _merged(entry.policies, policies)
        if indexes:
            entry.indexes = _merged(entry.indexes, indexes)
        if weight is not None:
            entry.weight = weight
        entry.keys.append(
            KeyEntry(
                sha256=hash_key(api_key),
                created=utc_text(datetime.now(UTC)),
                label=label,
                labels=labels or {},
                expires_at=expires_at,
                limits=limits or Limits(),
                models=models,
                quota_id=quota_id,
            )
        )
        # Validated as a whole: a bad policy or index name is refused before anything is written.
        try:
            checked = KeysFile.model_validate(keys_file.model_dump())
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ValueError(
                f"field '{'.'.join(str(part) for part in first['loc'])}': {first['msg']}"
            ) from None
        write_keys_file(path, checked)
    return api_key


def _merged(existing: list[str] | None, added: list[str]) -> list[str]:
    return list(dict.fromkeys([*(existing or []), *added]))


def find_key(keys_file: KeysFile, key_or_id: str) -> tuple[str, KeyEntry]:
    """(tenant, entry) for a key id (a unique prefix of its hash, 8+ hex digits) or the key itself."""
    prefix = hash_key(key_or_id) if key_or_id.startswith(KEY_PREFIX) else key_or_id.lower()
    if len(prefix) < 8:
        raise ValueError(
            f"'{key_or_id}': give the key id from `ctxgate keys list` (8+ hex digits) or the key"
        )
    matches = [
        (name, key)
        for name, tenant in keys_file.tenants.items()
        for key in tenant.keys
        if key.sha256.startswith(prefix)
    ]
    if not matches:
        raise ValueError(f"no key '{key_or_id}' in the keys file")
    if len(matches) > 1:
        raise ValueError(f"'{key_or_id}' matches {len(matches)} keys; give more digits")
    return matches[0]


def revoke_key(path: str | Path, key_or_id: str, at: datetime | None = None) -> tuple[str, KeyEntry]:
    """Mark a key revoked from `at` (default now); gateways refuse it after their next reload."""
    with locked_keys_file(path) as keys_file:
        tenant, entry = find_key(keys_file, key_or_id)
        if entry.revoked_at is None:
            entry.revoked_at = at or datetime.now(UTC).replace(microsecond=0)
        write_keys_file(path, keys_file)
    return tenant, entry


def rotate_key(path: str | Path, key_or_id: str, grace_s: float = 0.0) -> tuple[str, str, KeyEntry]:
    """A new key with the old one's tenant, limits, models, labels and counters; the old one is revoked
    (after `grace_s` seconds: it expires then, so clients can switch over). Returns (tenant, new key, old entry)."""
    with locked_keys_file(path) as keys_file:
        tenant, old = find_key(keys_file, key_or_id)
        if old.status(datetime.now(UTC)) != "active":
            raise ValueError(
                f"key {old.key_id} is {old.status(datetime.now(UTC))}; only an active key can be rotated"
            )
        api_key = generate_key()
        new = old.model_copy(
            update={
                "sha256": hash_key(api_key),
                "created": utc_text(datetime.now(UTC)),
                "revoked_at": None,
                "quota_id": old.quota_id or old.key_id,
            }
        )
        now = datetime.now(UTC).replace(microsecond=0)
        if grace_s > 0:
            grace_end = now + timedelta(seconds=grace_s)
            old.expires_at = min(aware(old.expires_at), grace_end) if old.expires_at else grace_end
        else:
            old.revoked_at = now
        keys_file.tenants[tenant].keys.append(new)
        write_keys_file(path, keys_file)
    return tenant, api_key, old


def set_key_limits(path: str | Path, key_or_id: str, limits: Limits) -> tuple[str, KeyEntry]:
    """Replace a key's own limits (those of its tenant are unchanged); gateways apply them after their
    next reload. Returns (tenant, the updated entry)."""
    with locked_keys_file(path) as keys_file:
        tenant, entry = find_key(keys_file, key_or_id)
        entry.limits = limits
        write_keys_file(path, keys_file)
    return tenant, entry
