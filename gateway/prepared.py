"""What the gateway decided about one request before the model is called (`Prepared`), handed from
preparation to generation and to the settlement of its usage; for `/v1/ctxgate/compress`, which
calls no model, `Compressed`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ctxgate.backend.engine.api import Priority, SamplingParams
from ctxgate.backend.openai_api.request_params import EngineAsks
from ctxgate.compression.types import CompressionResult
from ctxgate.gateway.budget_control import Decision
from ctxgate.gateway.fit import Fit
from ctxgate.gateway.keys import Tenant
from ctxgate.gateway.quota import RateLimitState, Reservation
from ctxgate.policies.schema import Policy


@dataclass
class Prepared:
    """Everything decided before the model is called."""

    request_id: str
    tenant: Tenant
    policy: Policy
    result: CompressionResult
    prompt_token_ids: list[int]
    prompt_text: str
    sampling: SamplingParams
    priority: Priority
    reservation: Reservation | None = None
    # Fields the built-in engine could not honour, dropped under drop_params (usage.ctxgate).
    dropped_params: list[str] = field(default_factory=list)
    # Upstream mode: the client's fields forwarded untouched (GenerationRequest.forward).
    forward: dict[str, Any] | None = None
    # Sequences the upstream generates per request (`n`, `best_of`): the reservation counts each.
    choices: int = 1
    # Built-in mode: what the request asks of the engine beyond plain sampling, and how to answer.
    asks: EngineAsks | None = None
    # A model list: the key of the prompt's stable prefix for cache-affinity routing.
    route_key: str | None = None
    # Adaptive policies: the documents budget the controller chose for this request, and why.
    budget: Decision | None = None
    # A request fitted into a limit it did not fit (gateway/fit.py): usage.ctxgate.fit.
    fit: Fit | None = None
    # perf_counter when the request reached the gateway (before its body was read and compressed),
    # and when its first token came back: the gateway's TTFT, which the budget controller learns from.
    received_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class Compressed:
    """A `/v1/ctxgate/compress` request, prepared: the policy it ran under and what compression made."""

    policy: Policy
    result: CompressionResult
    # What the tenant's request and token limits have left after this request (None: no such limits).
    rate_limits: RateLimitState | None = None
    fit: Fit | None = None


def rate_limit_headers(state: RateLimitState | None) -> dict[str, str]:
    """The `x-ratelimit-*` headers of a response; none for a tenant without request or token limits."""
    return state.headers() if state is not None else {}


def compression_figures(result: CompressionResult) -> dict[str, Any]:
    """What a compression saved and cost, as `usage.ctxgate` and the compress report show it: per
    stage, and the totals a reader wants first. `message_context` only when the passages came from
    the messages (documents in the extension leave it out)."""
    compression_ms = result.compression_ms
    found = result.message_context
    return {
        "original_prompt_tokens": result.original_prompt_tokens,
        "prompt_tokens": result.prompt_tokens,
        "saved_tokens_total": result.saved_tokens_total,
        "reduction": result.reduction,
        "estimated_prefill_ms_saved": result.estimated_prefill_ms_saved,
        "compression_ms_total": round(sum(compression_ms.values()), 3),
        "saved_tokens": result.saved_tokens,
        "compression_ms": compression_ms,
        "compression_wait_ms": round(result.wait_ms, 3),
        "compression_engine_ms": round(result.engine_ms, 3),
    } | ({"message_context": found} if found and found.get("passages_found") else {})
