"""Conversation memory: how each turn of a conversation was sent, so the next turn sends it again
byte-identical (the engine's prefix cache still holds it) and does not send a passage again.

A record per conversation holds, for every client turn so far, a digest of what the client wrote
and, for a turn that was a question, the passages block sent with it (plus digests of its sentences,
for cross-turn dedup); the turns before `start` are in the rolled summary or dropped. Records live in
the pipeline's byte cache (in-process LRU, or Redis shared by replicas), under a key that holds the
tenant: one tenant can neither read nor overwrite another's. A record carries its own expiry, so an
LRU that keeps it longer than the policy's `ttl_s` still forgets it; a record that does not parse
is a miss.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ctxgate.compression.state import Passage, message_text
from ctxgate.compression.store.cache import BytesCache
from ctxgate.compression.text import content_hash, normalize_for_dedup

RECORD_VERSION = 1


def turn_digest(message: dict[str, Any]) -> str:
    """What identifies a client turn: its role, text and tool calls (the text as the pipeline got it)."""
    calls = message.get("tool_calls") or message.get("function_call")
    return content_hash(json.dumps([message.get("role"), message_text(message), calls], ensure_ascii=False))


def sentence_digest(sentence: str) -> str:
    """A sentence as cross-turn dedup compares it: case, accents, punctuation and spacing ignored."""
    return content_hash(normalize_for_dedup(sentence))[:16]


def sent_sentences(passages: list[Passage]) -> list[str]:
    """The digests of the sentences the passages' bodies hold (a passage never split is one)."""
    texts: list[str] = []
    for passage in passages:
        texts.extend([passage.body()] if passage.sentences is None else passage.body_sentences())
    return [sentence_digest(text) for text in texts if text.strip()]


@dataclass
class SentTurn:
    digest: str  # turn_digest of the client's message
    context: str | None = None  # the passages block sent before its text (a question turn)
    sentences: list[str] = field(default_factory=list)  # sentence digests of that block


@dataclass
class ConversationRecord:
    turns: list[SentTurn]
    start: int = 0  # turns before this one are in the summary, or were dropped
    summary: str | None = None
    expires_at: float = 0.0

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "v": RECORD_VERSION,
                "turns": [[t.digest, t.context, t.sentences] for t in self.turns],
                "start": self.start,
                "summary": self.summary,
                "expires_at": self.expires_at,
            },
            ensure_ascii=False,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ConversationRecord | None:
        """None for anything but a record this version wrote (an old or damaged entry is a miss)."""
        try:
            raw = json.loads(data)
            if raw.get("v") != RECORD_VERSION:
                return None
            turns = [
                SentTurn(str(d), None if c is None else str(c), [str(s) for s in ss])
                for d, c, ss in raw["turns"]
            ]
            summary = raw["summary"]
            return cls(
                turns, int(raw["start"]), None if summary is None else str(summary), float(raw["expires_at"])
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


@dataclass
class CarriedTurns:
    """The history as memory carried it into this request (compression/stages/conversation.py): what
    the pipeline remembers once the prompt is sent."""

    turns: list[SentTurn]  # one per client history message, in order
    start: int  # history messages before this one are in the summary or dropped
    matched: int  # leading history messages rendered from memory
    ttl_s: float


def memory_key(tenant: str, conversation: str) -> str:
    """The tenant's hash is part of the key: another tenant's key never names this entry."""
    tenant_part = hashlib.sha256(tenant.encode()).hexdigest()[:16]
    return f"conv:{tenant_part}:{hashlib.sha256(conversation.encode()).hexdigest()}"


class ConversationMemory:
    def __init__(self, cache: BytesCache, clock: Callable[[], float] = time.time):
        self.cache = cache
        self.clock = clock

    def load(self, tenant: str, conversation: str) -> ConversationRecord | None:
        data = self.cache.get(memory_key(tenant, conversation))
        record = ConversationRecord.from_bytes(data) if data is not None else None
        if record is None or record.expires_at <= self.clock():
            return None
        return record

    def save(self, tenant: str, conversation: str, record: ConversationRecord, ttl_s: float) -> None:
        record.expires_at = self.clock() + ttl_s
        self.cache.set(memory_key(tenant, conversation), record.to_bytes(), ttl_s)


def matched_turns(history: list[dict[str, Any]], record: ConversationRecord | None) -> int:
    """How many leading history messages are the turns the record remembers, in order."""
    if record is None:
        return 0
    matched = 0
    for message, turn in zip(history, record.turns, strict=False):
        if turn_digest(message) != turn.digest:
            break
        matched += 1
    return matched
