"""Server-sent events as OpenAI streams them: `data: <compact JSON>\\n\\n` frames, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
_DATA = "data:"
_DONE_DATA = "[DONE]"


def sse_event(payload: dict[str, Any]) -> str:
    """One SSE frame holding `payload` as compact JSON."""
    return f"{_DATA} {json.dumps(payload, separators=(',', ':'))}\n\n"


def event_stream_response(events: AsyncIterable[str]) -> StreamingResponse:
    # No caching, and no proxy buffering: a buffered stream would arrive all at once at the end.
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def read_sse_payloads(lines: AsyncIterable[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of the `data:` lines of a stream, until `[DONE]`; other lines are skipped."""
    async for line in lines:
        if not line.startswith(_DATA):
            continue
        data = line[len(_DATA) :].strip()
        if data == _DONE_DATA:
            return
        try:
            payload = json.loads(data)
        except ValueError:
            logger.warning("ignoring a malformed SSE line: %.100s", data)
            continue
        if isinstance(payload, dict):
            yield payload
