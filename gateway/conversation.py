"""Which conversation a chat request continues: the key of its conversation memory and, on a model
list, of its cache-affinity routing (so turn N+1 lands where turn N's prefix lives).

Every turn of a conversation resends the same system prompt and first user turn, whatever passages
each turn carries in the ctxgate extension, so the key is a digest of those (as the client wrote
them, before compression: the compressed first turn of a RAG chat holds that turn's passages, which
later turns may not) with the tenant's cache salt in front; a client that names its conversations
(`ctxgate.conversation_id`, validated in gateway/schemas.py) gets a digest of that id instead. The
salt is the tenant's: two tenants' identical conversations never share a key.
"""

from __future__ import annotations

import hashlib
from typing import Any


def conversation_key(salt: str, messages: list[dict[str, Any]], conversation_id: str | None) -> str | None:
    """A hex digest naming the conversation; None when there is nothing to recognise it by."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(salt.encode())
    if conversation_id is not None:
        digest.update(b"\x00id\x00" + conversation_id.encode())
        return digest.hexdigest()
    opening = opening_turns(messages)
    if not opening:
        return None
    digest.update(b"\x00turns")
    for role, text in opening:
        digest.update(b"\x00" + role.encode() + b"\x1f" + text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def opening_turns(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The system messages before the first user turn, and that turn: what every later turn repeats."""
    opening: list[tuple[str, str]] = []
    for message in messages:
        content = message.get("content")
        role = str(message.get("role"))
        opening.append((role, content if isinstance(content, str) else ""))
        if role == "user":
            return opening
    return []
