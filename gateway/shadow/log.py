"""The shadow log: one JSON line per comparison, appended to the file `server.shadow_log` names, for
`ctxgate eval shadow-replay` (eval/shadow_replay.py). Prompts are logged as SHA-256 hashes only; the
answers are logged whole. Rotation is the operator's (logrotate's copytruncate works: each line is
one append)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

from ctxgate.gateway.shadow.ledger import ShadowRecord


def prompt_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def log_line(record: ShadowRecord, live_answer: str, shadow_answer: str, hashes: dict[str, str]) -> str:
    entry: dict[str, Any] = record.as_dict() | {
        "live_answer": live_answer,
        "shadow_answer": shadow_answer,
        "prompt_hash_live": hashes["live"],
        "prompt_hash_shadow": hashes["shadow"],
    }
    return json.dumps(entry, ensure_ascii=False) + "\n"


class ShadowLog:
    def __init__(self, path: Path):
        self.path = path
        self._lock = asyncio.Lock()

    async def write(self, line: str) -> None:
        async with self._lock:  # whole lines, in order
            await asyncio.to_thread(self._append, line)

    def _append(self, line: str) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line)
