"""An `EngineClient` that forwards to OpenAI-compatible servers (ctxgate engine serve, vLLM, SGLang).

Requests always stream from the upstream, so time-to-first-token is measured here and a client that
goes away closes the upstream connection (which is how vLLM-style servers learn to abort). Connection
failures before the first byte are retried and fail over to the next URL; once tokens have flowed a
request is never replayed (the client would see them twice).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from ctxgate.backend.engine.api import (
    NO_GROUPS,
    EngineError,
    GenerationDelta,
    GenerationRequest,
    RequestMetrics,
)
from ctxgate.backend.openai_api.sse import read_sse_payloads
from ctxgate.backend.routing.upstream_metrics import UpstreamMetrics

logger = logging.getLogger(__name__)

# Statuses that mean "this replica cannot take it right now", worth trying another one.
_FAILOVER_STATUSES = {502, 503, 504}
# Request fields the gateway decides (compressed messages, clamped max_tokens, the upstream's model
# name, streaming), that only the gateway understands, or that cross tenants: `priority` would let
# a tenant jump the upstream's queue, `cache_salt` (vLLM's prefix-cache namespace) is the
# gateway's per-tenant value, never the client's, and a client's `request_id` could collide with
# another tenant's request on the upstream. Every other client field is forwarded.
GATEWAY_OWNED = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "stop",
        "ctxgate",
        "priority",
        "cache_salt",
        "request_id",
    }
)


@dataclass
class UpstreamConfig:
    urls: list[str]
    model: str | None = None  # model name sent upstream; discovered from /v1/models when None
    api_key: str | None = None
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 120.0
    retries: int = 1  # extra attempts per URL on connection errors
    down_for_s: float = 5.0  # skip a URL that just failed for this long (unless all are down)
    max_model_len: int = 8192
    extra_headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("an upstream client needs at least one URL")
        self.urls = [url.rstrip("/") for url in self.urls]
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"upstream URL must start with http:// or https://: {url}")


class UpstreamUnavailable(EngineError):
    def __init__(self, message: str):
        super().__init__(message, status_code=502)


class UpstreamRefused(EngineError):
    """An upstream's 4xx. Its text is the upstream's (a traceback, a file path, an internal URL):
    `detail` is for the log; clients get a generic message with the status and, where they are plain
    identifiers, the OpenAI error's `param` and `code`."""

    def __init__(self, status_code: int, detail: str, param: str | None, code: str | None):
        super().__init__(
            f"the model backend refused the request (HTTP {status_code})",
            status_code=status_code,
            param=param,
            code=code,
        )
        self.detail = detail


def _base(url: str) -> str:
    return url[: -len("/v1")] if url.endswith("/v1") else url


class UpstreamClient:
    """EngineClient over HTTP with timeouts, retries, failover and streaming passthrough."""

    tokenizer = None  # the gateway counts with its own local tokenizer for this model
    # The client's fields go to the upstream untouched and its chunks come back as they are
    # (`GenerationRequest.forward`, `GenerationDelta.raw`): the upstream decides what it supports.
    forwards_fields = True
    side_work = None  # a remote server has no thread here to share
    groups = NO_GROUPS  # one served model; a model list is a ModelRouter over several of these

    def __init__(self, config: UpstreamConfig, served_model_name: str | None = None):
        self.config = config
        # Until /v1/models answers, the configured name; then the upstream's own unless one was given.
        self._name_given = bool(served_model_name or config.model)
        self.model_name = served_model_name or config.model or "upstream"
        self.max_model_len = config.max_model_len
        # The compute path a ctxgate engine upstream reports on /v1/models (None for other servers).
        self.path_info: dict[str, object] | None = None
        self._upstream_model = config.model
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=config.connect_timeout_s,
                read=config.read_timeout_s,
                write=config.read_timeout_s,
                pool=config.connect_timeout_s,
            ),
            headers={
                **({"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}),
                **config.extra_headers,
            },
        )
        self._down_until: dict[str, float] = {}
        self._round_robin = itertools.cycle(range(len(config.urls)))
        self._active: dict[str, httpx.Response] = {}
        self._healthy = False
        self.connection_errors = 0  # attempts that failed before a response (for metrics)
        self.metrics = UpstreamMetrics(self)  # per-upstream health and latency, on the gateway's /metrics

    # -- health --------------------------------------------------------------------------------
    def is_ready(self) -> bool:
        return self._healthy

    @property
    def needs_health_check(self) -> bool:
        """True until an upstream has answered /v1/models (so its model name is known)."""
        return not self._healthy or self._upstream_model is None

    async def check_health(self) -> bool:
        """Ask each upstream for its models; learns the upstream model name and context length."""
        healthy = False
        for url in self.config.urls:
            try:
                response = await self._client.get(f"{_base(url)}/v1/models")
                response.raise_for_status()
                models = response.json().get("data") or []
            except (httpx.HTTPError, ValueError) as exc:
                logger.warning("upstream %s not healthy: %s", url, exc)
                self._down_until[url] = time.monotonic() + self.config.down_for_s
                continue
            healthy = True
            self._down_until.pop(url, None)
            if models and self._upstream_model is None:
                self._upstream_model = models[0].get("id")
            if self._upstream_model and not self._name_given:
                self.model_name = self._upstream_model
            if models and models[0].get("max_model_len"):
                self.max_model_len = int(models[0]["max_model_len"])
            if models and isinstance(models[0].get("engine_path"), dict):
                self.path_info = models[0]["engine_path"]
        self._healthy = healthy
        return healthy

    def start(self) -> None:
        """Nothing to launch: connections open per request, and `check_health` learns the model."""

    async def stop(self) -> None:
        await self._client.aclose()

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """Per-upstream health and latency; the upstream server exposes its own engine metrics."""
        return self.metrics.registry

    # -- generation ----------------------------------------------------------------------------
    def _candidate_urls(self) -> list[str]:
        start = next(self._round_robin)
        ordered = self.config.urls[start:] + self.config.urls[:start]
        now = time.monotonic()
        up = [url for url in ordered if self._down_until.get(url, 0) <= now]
        down = [url for url in ordered if url not in up]
        return up + down  # try the ones that just failed last, but still try them

    def _body(self, request: GenerationRequest) -> tuple[str, dict[str, Any]]:
        sampling = request.sampling
        if request.forward is not None:
            # The client's own fields, untouched (sampling included: an absent field stays absent, so
            # the upstream applies its own defaults); only what the gateway decides is set below.
            body = {key: value for key, value in request.forward.items() if key not in GATEWAY_OWNED}
        else:
            body = {"temperature": sampling.temperature, "top_p": sampling.top_p}
            if sampling.seed is not None:
                body["seed"] = sampling.seed
            if sampling.top_k:
                body["top_k"] = sampling.top_k
            if sampling.ignore_eos:
                body["ignore_eos"] = True
        body |= {
            "model": self._upstream_model or self.model_name,
            "max_tokens": sampling.max_tokens,  # the policy's clamp
            # Always streamed, with usage: TTFT is measured here and usage feeds the quota.
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sampling.stop:
            body["stop"] = sampling.stop  # empty strings filtered: they would stop at once
        if request.cache_salt:
            body["cache_salt"] = request.cache_salt  # tenants never share the upstream's prefix cache
        if request.messages is not None:
            body["messages"] = request.messages
            return "/v1/chat/completions", body
        body["prompt"] = request.prompt_text if request.prompt_text is not None else request.prompt_token_ids
        return "/v1/completions", body

    async def _open_stream(self, request: GenerationRequest) -> tuple[str, httpx.Response]:
        path, body = self._body(request)
        errors: list[str] = []
        for url in self._candidate_urls():
            for attempt in range(self.config.retries + 1):
                try:
                    http_request = self._client.build_request("POST", f"{_base(url)}{path}", json=body)
                    response = await self._client.send(http_request, stream=True)
                except (
                    httpx.ConnectError,
                    httpx.ConnectTimeout,
                    httpx.RemoteProtocolError,
                    httpx.PoolTimeout,
                ) as exc:
                    self.connection_errors += 1
                    self.metrics.failure(url, "connect")
                    errors.append(f"{url}: {exc.__class__.__name__}")
                    if attempt < self.config.retries:
                        await asyncio.sleep(0.05 * (attempt + 1))
                    continue
                if response.status_code in _FAILOVER_STATUSES:
                    self.metrics.failure(url, "status")
                    await response.aread()
                    await response.aclose()
                    errors.append(f"{url}: HTTP {response.status_code}")
                    break
                if response.status_code >= 400:
                    await response.aread()
                    await response.aclose()
                    param, code = _error_fields(response)
                    raise UpstreamRefused(
                        response.status_code, f"{url}: {_error_message(response)}", param, code
                    )
                self._down_until.pop(url, None)
                self._healthy = self._upstream_model is not None
                return url, response
            self._down_until[url] = time.monotonic() + self.config.down_for_s
        self._healthy = False
        raise UpstreamUnavailable("no upstream could take the request: " + "; ".join(errors))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        started = time.perf_counter()
        url, response = await self._open_stream(request)
        self._active[request.request_id] = response
        first_token_at: float | None = None
        finish_reason: str | None = None
        usage: dict[str, Any] = {}
        completion_text_chunks = 0
        relay = request.forward is not None
        try:
            async for payload in read_sse_payloads(response.aiter_lines()):
                if "error" in payload and not payload.get("choices"):
                    error = payload["error"]
                    message = (
                        error.get("message", "upstream error") if isinstance(error, dict) else str(error)
                    )
                    raise EngineError(f"upstream error: {message}", status_code=502)
                if payload.get("usage"):
                    usage = payload["usage"]
                texts: list[str] = []
                for choice in payload.get("choices") or []:
                    text = (
                        (choice.get("delta") or {}).get("content")
                        if "delta" in choice
                        else choice.get("text")
                    )
                    if text and int(choice.get("index", 0)) == 0:
                        texts.append(text)
                    if choice.get("finish_reason"):
                        finish_reason = choice["finish_reason"]
                if texts or (relay and payload.get("choices")):
                    if texts and first_token_at is None:
                        first_token_at = time.perf_counter()
                    completion_text_chunks += bool(texts)
                    yield GenerationDelta(
                        request_id=request.request_id,
                        text="".join(texts),
                        token_ids=[],
                        raw=payload if relay else None,
                    )
        except httpx.ReadTimeout as exc:
            self.metrics.failure(url, "timeout")
            raise EngineError(f"upstream {url} read timeout", status_code=504) from exc
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            self.metrics.failure(url, "stream")
            raise EngineError(f"upstream {url} closed the stream: {exc}", status_code=502) from exc
        finally:
            self._active.pop(request.request_id, None)
            await response.aclose()
        ended = time.perf_counter()
        ttft_ms = ((first_token_at or ended) - started) * 1000
        self.metrics.observe(url, ttft_ms / 1000, ended - started)
        completion_tokens = int(usage.get("completion_tokens") or completion_text_chunks)
        ctxgate_usage = usage.get("ctxgate") or {}
        details = usage.get("prompt_tokens_details") or {}
        metrics = RequestMetrics(
            queue_ms=float(ctxgate_usage.get("queue_ms", 0.0)),
            prefill_ms=float(ctxgate_usage.get("prefill_ms", 0.0)),
            ttft_ms=ttft_ms,
            tpot_ms=((ended - (first_token_at or ended)) * 1000 / (completion_tokens - 1))
            if completion_tokens > 1
            else 0.0,
            e2e_ms=(ended - started) * 1000,
            cached_prompt_tokens=int(
                details.get("cached_tokens") or ctxgate_usage.get("cached_prompt_tokens") or 0
            ),
        )
        yield GenerationDelta(
            request_id=request.request_id,
            text="",
            token_ids=[],
            finish_reason=finish_reason or "stop",
            prompt_tokens=int(usage.get("prompt_tokens") or len(request.prompt_token_ids)),
            completion_tokens=completion_tokens,
            metrics=metrics,
            usage=usage or None,
        )

    async def abort(self, request_id: str) -> None:
        response = self._active.pop(request_id, None)
        if response is not None:
            await response.aclose()  # closing the connection is the abort signal upstream


def _error_object(response: httpx.Response) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None


def _error_message(response: httpx.Response) -> str:
    """The upstream's own words, for the log only."""
    error = _error_object(response)
    if error is not None and error.get("message"):
        return f"upstream: {error['message']}"
    return f"upstream returned HTTP {response.status_code}: {response.text[:200]}"


# What an OpenAI error's `param` (`messages[0].content`, `tools[2]`) and `code` (`invalid_value`) look
# like; anything else is free text and stays in the log.
_SAFE_PARAM = re.compile(r"[A-Za-z_][A-Za-z0-9_.\[\]]{0,63}")
_SAFE_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")


def _error_fields(response: httpx.Response) -> tuple[str | None, str | None]:
    """The `param` and `code` of an OpenAI-style error body, when they are plain identifiers (None
    when absent, not JSON, or anything else)."""
    error = _error_object(response)
    if error is None:
        return None, None
    param, code = error.get("param"), error.get("code")
    return (
        (param if isinstance(param, str) and _SAFE_PARAM.fullmatch(param) else None),
        (code if isinstance(code, str) and _SAFE_CODE.fullmatch(code) else None),
    )
