"""The cache-affinity key of a request: what of its prompt later requests will repeat.

A conversation resends its system prompt and first user turn at the start of every later turn, and
RAG requests of one application share their system prompt and, with a stable assembly order, their
leading passages. So the key is the prompt's stable prefix as the gateway assembled it (after
compression): the system messages and the first other message, cut to a number of characters, with
the tenant's cache salt in front, since tenants never share the upstream's prefix cache anyway.
The same request gives the same key on every gateway replica.
"""

from __future__ import annotations

import hashlib
from typing import Any


def stable_prefix(messages: list[dict[str, Any]] | None, prompt_text: str | None, limit_chars: int) -> str:
    """The leading text every later request of the same conversation or application starts with."""
    if messages is None:
        return (prompt_text or "")[:limit_chars]
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        parts.append(f"{message.get('role')}\x1f{content if isinstance(content, str) else ''}")
        if message.get("role") != "system":
            break  # the first turn after the system prompt names the conversation
    return "\x1e".join(parts)[:limit_chars]


def affinity_key(
    salt: str, messages: list[dict[str, Any]] | None, prompt_text: str | None, limit_chars: int
) -> str | None:
    """A hex digest of the salt and the stable prefix; None when there is no prefix to share."""
    prefix = stable_prefix(messages, prompt_text, limit_chars)
    if not prefix:
        return None
    return hashlib.blake2b(f"{salt}\x00{prefix}".encode(), digest_size=16).hexdigest()
