"""One streamed OpenAI chat completion timed on the client side: the time to the first content
chunk, to the end, the content chunks and the final usage. Used by every benchmark that talks to a
server over HTTP (`bench e2e`, `bench engine`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ctxgate.backend.openai_api.sse import read_sse_payloads


@dataclass
class StreamTiming:
    ttft_s: float
    e2e_s: float
    content_chunks: int
    usage: dict[str, Any] = field(default_factory=dict)


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], first_token_timeout_s: float | None = None
) -> StreamTiming:
    """POST `body` to `url`/v1/chat/completions as a stream. A non-200 answer or an in-stream error
    raises RuntimeError with the server's text (the caller records it per request). With
    `first_token_timeout_s`, a request without a first token by then is abandoned (TimeoutError;
    closing the stream makes the server abort it), as a user who gives up would."""
    started = time.perf_counter()
    first: float | None = None
    chunks = 0
    usage: dict[str, Any] = {}
    async with asyncio.timeout(first_token_timeout_s) as deadline:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {detail[:300]}")
            async for chunk in read_sse_payloads(response.aiter_lines()):
                if "error" in chunk:
                    raise RuntimeError(f"in-stream error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter()
                            deadline.reschedule(None)  # the rest of the answer has no deadline
    ended = time.perf_counter()
    return StreamTiming(
        ttft_s=(first or ended) - started, e2e_s=ended - started, content_chunks=chunks, usage=usage
    )
