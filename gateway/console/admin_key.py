"""The console's admin key: read once from its file, kept only as its sha256, compared in constant time.

It is not a tenant key: the API routes refuse it (`ctxgate.gateway.access`), and the console takes
nothing else. Secrets the console derives (the session signing key) come from its digest, so every
replica given the same file accepts the same sessions, and a new key ends every old session.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

MIN_ADMIN_KEY_CHARS = 32
WHERE = "field 'server.admin_key_file' (--admin-key-file)"


class AdminKeyError(ValueError):
    """An admin key file that cannot be used; the message names the setting and the reason."""


@dataclass(frozen=True)
class AdminKey:
    digest: bytes  # sha256 of the key; the key itself is not kept in memory

    def matches(self, given: str | None) -> bool:
        if not given:
            return False
        # Hashes of equal length: the comparison's time says nothing about the key.
        return hmac.compare_digest(hashlib.sha256(given.encode("utf-8")).digest(), self.digest)

    def derive(self, purpose: str) -> bytes:
        """A secret for one purpose (signing sessions), the same on every replica with this key."""
        return hmac.new(self.digest, purpose.encode("utf-8"), hashlib.sha256).digest()


def load_admin_key(path: str | Path) -> AdminKey:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AdminKeyError(f"{WHERE}: cannot read {path}: {exc}") from None
    key = text.strip()
    if "\n" in key or "\r" in key:
        raise AdminKeyError(f"{WHERE}: {path} must hold the key on one line")
    if len(key) < MIN_ADMIN_KEY_CHARS:
        raise AdminKeyError(
            f"{WHERE}: the key in {path} has {len(key)} characters; use {MIN_ADMIN_KEY_CHARS} or more "
            "(e.g. `openssl rand -hex 32 > admin.key`)"
        )
    return AdminKey(hashlib.sha256(key.encode("utf-8")).digest())


def admin_key_problems(path: Path | None) -> list[str]:
    """What `serve` checks before the model loads (empty: fine or not configured)."""
    if path is None:
        return []
    try:
        load_admin_key(path)
    except AdminKeyError as exc:
        return [str(exc)]
    return []
