"""Talks to a running ctxgate gateway exactly as an application would: the OpenAI SDK for chat
completions (streamed, to measure TTFT and TPOT on the client side) and plain HTTP for
POST /v1/ctxgate/compress, which returns the messages the gateway would send."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ctxgate.client import ctxgate_extra_body
from ctxgate.eval.datasets import EvalExample

SYSTEM_PROMPT = (
    "Answer the question using the documents provided. Reply with the short answer only "
    "(a few words), without explanation."
)


def question_messages(example: EvalExample, cache_buster: str | None = None) -> list[dict[str, str]]:
    """System prompt + question. A `cache_buster` goes first in the system prompt, so the prompt
    shares no KV block with any earlier request (benchmarks must not be flattered by prefix caching)."""
    system = f"[{cache_buster}] {SYSTEM_PROMPT}" if cache_buster else SYSTEM_PROMPT
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": example.question},
    ]


def ctxgate_extra(
    example: EvalExample, policy: str, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The `ctxgate` request extension for a question: its passages, the policy, any overrides."""
    return ctxgate_extra_body(example.documents(), policy=policy, overrides=overrides)


@dataclass
class ChatOutcome:
    reply: str = ""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    latency_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_ctxgate: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    retry_after_s: float | None = None  # set on 429 (over quota)


@dataclass
class CompressOutcome:
    messages: list[dict[str, Any]] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def _usage_extra(usage: Any) -> dict[str, Any]:
    """`usage.ctxgate` from an OpenAI SDK usage object (extra fields are kept by the SDK)."""
    if usage is None:
        return {}
    dumped = usage.model_dump() if hasattr(usage, "model_dump") else dict(usage)
    extra = dumped.get("ctxgate")
    return extra if isinstance(extra, dict) else {}


def _retry_after_s(exc: Exception) -> float:
    response = getattr(exc, "response", None)
    return retry_after_s(response.headers if response is not None else {})


def retry_after_s(headers: Any) -> float:
    """The seconds a 429's `Retry-After` header asks for (1 s when it is missing or not a number)."""
    header = headers.get("retry-after")
    try:
        return max(0.1, float(header)) if header else 1.0
    except ValueError:
        return 1.0


def _error_text(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    message = getattr(exc, "message", None) or str(exc)
    return f"HTTP {status}: {message}" if status else f"{type(exc).__name__}: {message}"


class GatewayClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0):
        from openai import AsyncOpenAI

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout_s)
        # max_retries=0: a retried request would hide errors and distort latencies.
        self._openai = AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=api_key or "ctxgate-eval",
            timeout=timeout_s,
            max_retries=0,
        )
        self._model: str | None = None

    async def close(self) -> None:
        await self._http.aclose()
        await self._openai.close()

    async def model(self) -> str:
        if self._model is None:
            models = await self._openai.models.list()
            if not models.data:
                raise RuntimeError(f"{self.base_url}/v1/models lists no model")
            self._model = models.data[0].id
        return self._model

    async def compress(
        self, example: EvalExample, policy: str, overrides: dict[str, Any] | None = None
    ) -> CompressOutcome:
        body = {
            "model": await self.model(),
            "messages": question_messages(example),
            **ctxgate_extra(example, policy, overrides),
        }
        try:
            response = await self._http.post("/v1/ctxgate/compress", json=body)
        except httpx.HTTPError as exc:
            return CompressOutcome(error=_error_text(exc))
        if response.status_code != 200:
            return CompressOutcome(error=f"HTTP {response.status_code}: {response.text[:500]}")
        payload = response.json()
        return CompressOutcome(messages=payload.get("messages", []), report=payload.get("report", {}))

    async def chat(
        self,
        example: EvalExample,
        policy: str,
        max_tokens: int,
        overrides: dict[str, Any] | None = None,
        temperature: float = 0.0,
        max_quota_waits: int = 5,
        cache_buster: str | None = None,
    ) -> ChatOutcome:
        """A streamed chat completion. A 429 (the tenant's quota) is waited out as its Retry-After
        says: the eval measures answers and latency, not the quota's configuration."""
        for _ in range(max_quota_waits):
            outcome = await self._chat_once(example, policy, max_tokens, overrides, temperature, cache_buster)
            if outcome.retry_after_s is None:
                return outcome
            await asyncio.sleep(min(outcome.retry_after_s, 60.0))
        return outcome

    async def _chat_once(
        self,
        example: EvalExample,
        policy: str,
        max_tokens: int,
        overrides: dict[str, Any] | None,
        temperature: float,
        cache_buster: str | None = None,
    ) -> ChatOutcome:
        """One streamed chat completion; TTFT is the first content chunk as the client sees it."""
        outcome = ChatOutcome()
        pieces: list[str] = []
        first_token_at: float | None = None
        last_token_at: float | None = None
        started = time.perf_counter()
        try:
            stream = await self._openai.chat.completions.create(
                model=await self.model(),
                messages=question_messages(example, cache_buster),  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=temperature,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=ctxgate_extra(example, policy, overrides),
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    outcome.prompt_tokens = chunk.usage.prompt_tokens
                    outcome.completion_tokens = chunk.usage.completion_tokens
                    outcome.usage_ctxgate = _usage_extra(chunk.usage)
                for choice in chunk.choices:
                    text = choice.delta.content if choice.delta else None
                    if text:
                        now = time.perf_counter()
                        first_token_at = first_token_at or now
                        last_token_at = now
                        pieces.append(text)
        except Exception as exc:  # noqa: BLE001 - any failure is recorded per question, not fatal
            outcome.error = _error_text(exc)
            if getattr(exc, "status_code", None) == 429:
                outcome.retry_after_s = _retry_after_s(exc)
        finished = time.perf_counter()
        outcome.reply = "".join(pieces)
        outcome.latency_ms = round((finished - started) * 1000, 3)
        if first_token_at is not None:
            outcome.ttft_ms = round((first_token_at - started) * 1000, 3)
            tokens = outcome.completion_tokens or 0
            if tokens > 1 and last_token_at is not None:
                outcome.tpot_ms = round((last_token_at - first_token_at) * 1000 / (tokens - 1), 3)
        return outcome
