"""Request orchestration, independent of HTTP: auth, policy, budget, quota, accounting.

The routes in `gateway.app` parse and respond; everything that decides something lives here.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from backend.api import EngineClient, EngineError, Priority, RequestMetrics, SamplingParams
from backend.openai_api.errors import APIError
from backend.openai_api.fields import enforce_supported
from backend.openai_api.responses import Usage
from compression.types import (
    BudgetExceededError,
    CompressionInput,
    CompressionResult,
    Document,
    RetrievalSpec,
)
from gateway.keys import KeyRejected, KeyStore, Tenant
from gateway.metrics import GatewayMetrics
from gateway.quota import SPEND_SCALE, QuotaExceeded, QuotaLimits, QuotaStore, Reservation, StoreUnavailable
from gateway.request_id import note_tenant
from gateway.sanitize import Neutraliser
from gateway.schemas import ChatCompletionRequest, CompletionRequest, CtxgateExtras, GatewayRequest
from gateway.settings import GatewaySettings
from policies.loader import PolicyRegistry, apply_overrides
from policies.schema import Policy

logger = logging.getLogger(__name__)


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
    received_at: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Outcome:
    """What the model produced, for usage and accounting."""

    text: str = ""
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    metrics: RequestMetrics | None = None


class Pipeline(Protocol):
    """What the gateway needs of a compressor (compression.pipeline.CompressionPipeline is the one)."""

    async def run(self, inp: CompressionInput, policy: Policy,
                  prepare: Callable[[CompressionInput], CompressionInput] | None = None) -> CompressionResult: ...


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        engine: EngineClient,
        tokenizer: Any,
        pipeline: Pipeline,
        policies: PolicyRegistry,
        keys: KeyStore,
        store: QuotaStore,
        metrics: GatewayMetrics,
    ):
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.policies = policies
        self.keys = keys
        self.store = store
        self.metrics = metrics
        self.neutraliser = Neutraliser(tokenizer)

    # -- identity and policy -------------------------------------------------------------------
    @property
    def model_names(self) -> list[str]:
        names = [self.settings.served_model_name or self.engine.model_name]
        if self.engine.model_name not in names:
            names.append(self.engine.model_name)
        return names

    def authenticate(self, authorization: str | None, api_key_header: str | None = None) -> Tenant:
        key = api_key_header
        if authorization:
            scheme, _, credentials = authorization.partition(" ")
            key = credentials.strip() if scheme.lower() == "bearer" else None
        try:
            tenant = self.keys.authenticate(key)
        except KeyRejected as exc:
            raise APIError(401, f"{exc}; ask for a new key", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"}) from None
        if tenant is not None:
            note_tenant(tenant.name)  # for the access log
        if tenant is None:
            message = "missing API key (Authorization: Bearer <key>)" if not key else "invalid API key"
            raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return tenant

    def check_model(self, model: str, tenant: Tenant | None = None) -> None:
        if model not in self.model_names:
            raise APIError(
                404, f"model '{model}' is not served here (available: {', '.join(self.model_names)})",
                param="model", code="model_not_found",
            )
        allowed = tenant.key.models if tenant is not None and tenant.key is not None else None
        if allowed is not None and model not in allowed:
            raise APIError(
                403, f"API key {tenant.key.key_id} may not use model '{model}' (allowed: {', '.join(allowed)})",
                param="model", code="model_not_allowed", error_type="permission_error",
            )

    def resolve_policy(self, tenant: Tenant, extras: CtxgateExtras | None) -> Policy:
        requested = extras.policy if extras else None
        name = requested or tenant.policy or self.settings.default_policy
        policy = self.policies.get(name)
        if policy is None:
            raise APIError(
                400 if requested else 503,
                f"unknown policy '{name}' (available: {', '.join(self.policies.names()) or 'none'})",
                param="ctxgate.policy" if requested else None, code="policy_not_found",
            )
        if extras and extras.overrides:
            try:
                policy = apply_overrides(policy, extras.overrides)
            except ValueError as exc:
                raise APIError(400, str(exc), param="ctxgate.overrides", code="override_not_allowed") from None
        return self.fit_to_model(policy)

    def fit_to_model(self, policy: Policy) -> Policy:
        """Cap the input budget at what the model can hold with at least one output token."""
        limit = self.engine.max_model_len - 1
        if policy.max_input_tokens <= limit:
            return policy
        return policy.model_copy(update={"max_input_tokens": limit})

    # -- request fields --------------------------------------------------------------------------
    @property
    def forwards_fields(self) -> bool:
        """Upstream mode: the engine sends the client's fields on instead of honouring them itself."""
        return bool(getattr(self.engine, "forwards_fields", False))

    def check_fields(self, body: GatewayRequest, policy: Policy,
                     raw: dict[str, Any] | None) -> tuple[list[str], dict[str, Any] | None]:
        """(dropped field names, fields to forward). The built-in engine refuses (400) what it cannot
        honour unless drop_params; an upstream gets the client's body, and decides itself."""
        if self.forwards_fields:
            return [], dict(raw) if raw is not None else body.model_dump(exclude_unset=True)
        return enforce_supported(body, policy.drop_params or self.settings.drop_params), None

    # -- budget --------------------------------------------------------------------------------
    async def compress(self, body: ChatCompletionRequest, tenant: Tenant, policy: Policy) -> CompressionResult:
        # Client text may not forge control tokens or context markers (gateway/sanitize.py). An
        # upstream also gets each message's other fields (tool_calls, tool_call_id, ...) back.
        # The neutraliser reads the whole request's text: it runs with the compression, off this loop.
        extra_fields = self.forwards_fields
        messages = [{"role": m.role, "content": m.text()}
                    | ({"name": m.name} if m.name else {}) | ((m.model_extra or {}) if extra_fields else {})
                    for m in body.messages]
        extras = body.ctxgate or CtxgateExtras()
        documents = [
            Document(text=d.text, id=None if d.id is None else str(d.id), title=d.title, score=d.score)
            for d in extras.documents or []
        ]
        retrieval = RetrievalSpec(extras.retrieval.index, extras.retrieval.top_n) if extras.retrieval else None
        inp = CompressionInput(messages=messages, documents=documents, retrieval=retrieval, tenant=tenant.name)
        try:
            result = await self.pipeline.run(inp, policy, prepare=self.neutraliser.compression_input)
        except BudgetExceededError as exc:
            self.metrics.budget_rejections.labels(policy.name).inc()
            raise APIError(413, str(exc), param="messages", code="prompt_too_long") from None
        except (ValueError, KeyError, FileNotFoundError) as exc:
            raise APIError(400, str(exc), code="invalid_request") from None
        for stage in result.stages:
            self.metrics.compression_seconds.labels(stage.name).observe(stage.ms / 1000)
        if policy.compression_enabled:
            self.metrics.compression_wait_seconds.observe(result.wait_ms / 1000)
        return result

    def encode_checked(self, result: CompressionResult, policy: Policy) -> tuple[list[int], str]:
        """Token ids actually sent; re-counted here so the budget holds whatever pipeline ran."""
        prompt_text = self.tokenizer.render_chat(result.messages)
        token_ids = self.tokenizer.encode(prompt_text)
        if len(token_ids) > policy.max_input_tokens:
            logger.error("pipeline produced %d tokens over budget %d", len(token_ids), policy.max_input_tokens)
            raise APIError(
                413, f"the prompt needs {len(token_ids)} tokens; policy '{policy.name}' allows "
                f"{policy.max_input_tokens}", code="prompt_too_long",
            )
        result.prompt_tokens = len(token_ids)
        return token_ids, prompt_text

    def sampling_for(self, body: GatewayRequest, policy: Policy, prompt_tokens: int) -> SamplingParams:
        requested = body.requested_max_tokens()
        room = self.engine.max_model_len - prompt_tokens
        max_tokens = min(requested or policy.reserve_output_tokens, policy.reserve_output_tokens, room)
        if max_tokens < 1:
            raise APIError(413, "the prompt leaves no room for output in the model's context", code="prompt_too_long")
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
            seed=body.seed, stop=body.stop_list(), stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos, min_tokens=min(body.min_tokens, max_tokens),
        )
        try:
            sampling.validate()
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        return sampling

    # -- quota ---------------------------------------------------------------------------------
    def limits_for(self, tenant: Tenant, policy: Policy) -> QuotaLimits:
        return QuotaLimits.from_policy(policy.quota, tenant.quota_override)

    @staticmethod
    def cost(policy: Policy, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        prompt_cost = prompt_tokens / 1000 * policy.cost.prompt_per_1k
        completion_cost = completion_tokens / 1000 * policy.cost.completion_per_1k
        return {
            "prompt": round(prompt_cost, 8),
            "completion": round(completion_cost, 8),
            "total": round(prompt_cost + completion_cost, 8),
            "currency": policy.cost.currency,
        }

    async def reserve(self, tenant: Tenant, policy: Policy, prompt_tokens: int, max_tokens: int,
                      slot_id: str | None = None) -> Reservation:
        """Reserve against the tenant's limits and its key's. `slot_id`: hold a parallel-request slot
        until the request is settled (generation); without it a parallel limit is only checked."""
        limits = self.limits_for(tenant, policy)
        key = tenant.key
        key_limits = QuotaLimits.from_mapping(key.limits) if key is not None and key.limits else None
        tokens = prompt_tokens + max_tokens
        spend_micros = int(round(self.cost(policy, prompt_tokens, max_tokens)["total"] * SPEND_SCALE))
        if limits.unlimited and key_limits is None:
            return Reservation(tenant.name, tokens, spend_micros, recorded=False)
        try:
            reservation = await self.store.reserve(
                tenant.name, limits, tokens, spend_micros, key_id=key.quota_id if key_limits else None,
                key_limits=key_limits, slot_id=slot_id)
        except QuotaExceeded as exc:
            self.metrics.quota_rejections.labels(tenant.name, exc.reason).inc()
            raise APIError(
                429, str(exc), code=exc.reason, error_type="rate_limit_error",
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from None
        except StoreUnavailable as exc:
            self.metrics.quota_store_up.set(0)
            action = limits.on_store_error
            self.metrics.quota_store_errors.labels(action).inc()
            logger.warning("%s; on_store_error=%s for tenant %s", exc, action, tenant.name)
            if action == "deny":
                raise APIError(
                    503, "quota store unavailable and the policy denies requests it cannot account for",
                    code="quota_store_unavailable", headers={"Retry-After": "1"},
                ) from None
            return Reservation(tenant.name, tokens, spend_micros, recorded=False)
        self.metrics.quota_store_up.set(1)
        return reservation

    async def reconcile(self, reservation: Reservation | None, tokens: int, spend: float) -> None:
        if reservation is None:
            return
        try:
            await self.store.reconcile(reservation, tokens, int(round(spend * SPEND_SCALE)))
        except StoreUnavailable as exc:
            self.metrics.quota_store_up.set(0)
            logger.warning("quota reconcile lost: %s", exc)

    async def release(self, prepared: Prepared) -> None:
        """Undo a reservation's tokens and spend (the request never reached the model)."""
        await self.reconcile(prepared.reservation, 0, 0.0)

    # -- the whole preparation -----------------------------------------------------------------
    async def prepare_chat(self, body: ChatCompletionRequest, tenant: Tenant,
                           raw: dict[str, Any] | None = None) -> Prepared:
        self.check_model(body.model, tenant)
        policy = self.resolve_policy(tenant, body.ctxgate)
        dropped, forward = self.check_fields(body, policy, raw)
        result = await self.compress(body, tenant, policy)
        token_ids, prompt_text = self.encode_checked(result, policy)
        sampling = self.sampling_for(body, policy, len(token_ids))
        priority = Priority.BACKGROUND if body.ctxgate and body.ctxgate.priority == "background" else Priority.USER
        prepared = Prepared(
            request_id=f"chatcmpl-{uuid.uuid4().hex}", tenant=tenant, policy=policy, result=result,
            prompt_token_ids=token_ids, prompt_text=prompt_text, sampling=sampling, priority=priority,
            dropped_params=dropped, forward=forward,
        )
        prepared.reservation = await self.reserve(tenant, policy, len(token_ids), sampling.max_tokens,
                                                  slot_id=prepared.request_id)
        return prepared

    async def prepare_completion(self, body: CompletionRequest, tenant: Tenant,
                                 raw: dict[str, Any] | None = None) -> Prepared:
        self.check_model(body.model, tenant)
        if body.ctxgate and (body.ctxgate.documents or body.ctxgate.retrieval):
            raise APIError(400, "documents and retrieval need /v1/chat/completions", param="ctxgate")
        policy = self.resolve_policy(tenant, body.ctxgate)
        dropped, forward = self.check_fields(body, policy, raw)
        prompt_text = body.prompt_text() or ""
        token_ids = self.tokenizer.encode(prompt_text)
        if not token_ids:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        if len(token_ids) > policy.max_input_tokens:
            self.metrics.budget_rejections.labels(policy.name).inc()
            raise APIError(
                413, f"the prompt has {len(token_ids)} tokens; policy '{policy.name}' allows "
                f"{policy.max_input_tokens} (raw prompts are never cut)", param="prompt", code="prompt_too_long",
            )
        result = CompressionResult(
            messages=[], original_prompt_tokens=len(token_ids), prompt_tokens=len(token_ids), stages=[]
        )
        sampling = self.sampling_for(body, policy, len(token_ids))
        prepared = Prepared(
            request_id=f"cmpl-{uuid.uuid4().hex}", tenant=tenant, policy=policy, result=result,
            prompt_token_ids=token_ids, prompt_text=prompt_text, sampling=sampling, priority=Priority.USER,
            dropped_params=dropped, forward=forward,
        )
        prepared.reservation = await self.reserve(tenant, policy, len(token_ids), sampling.max_tokens,
                                                  slot_id=prepared.request_id)
        return prepared

    # -- after the model -----------------------------------------------------------------------
    async def settle(self, prepared: Prepared, outcome: Outcome, count_metrics: bool = True) -> Usage:
        """Reconcile the quota, record metrics, and return `usage` (with `usage.ctxgate`)."""
        policy, tenant, result = prepared.policy, prepared.tenant, prepared.result
        prompt_tokens = outcome.prompt_tokens or result.prompt_tokens
        cost = self.cost(policy, prompt_tokens, outcome.completion_tokens)
        await self.reconcile(prepared.reservation, prompt_tokens + outcome.completion_tokens, cost["total"])
        if count_metrics:
            labels = (tenant.name, policy.name)
            self.metrics.prompt_tokens_original.labels(*labels).inc(result.original_prompt_tokens)
            self.metrics.prompt_tokens_sent.labels(*labels).inc(result.prompt_tokens)
            self.metrics.completion_tokens.labels(*labels).inc(outcome.completion_tokens)
            for stage, saved in result.saved_tokens.items():
                self.metrics.saved_tokens.labels(stage, policy.name).inc(max(0, saved))
            if cost["total"] > 0:
                self.metrics.spend.labels(tenant.name, cost["currency"]).inc(cost["total"])
        metrics = outcome.metrics or RequestMetrics()
        estimator = getattr(self.pipeline, "cost_estimator", None)
        if estimator is not None and metrics.prefill_ms > 0:
            # Measured prefill cost lets the pipeline skip compression that would not pay for itself.
            estimator.observe_prefill(prompt_tokens, metrics.prefill_ms)
        return Usage.of(
            prompt_tokens, outcome.completion_tokens, metrics.cached_prompt_tokens,
            ctxgate={
                "tenant": tenant.name,
                "policy": policy.name,
                "original_prompt_tokens": result.original_prompt_tokens,
                "prompt_tokens": result.prompt_tokens,
                "saved_tokens": result.saved_tokens,
                "compression_ms": result.compression_ms,
                "compression_wait_ms": round(result.wait_ms, 3),
                "compression_engine_ms": round(result.engine_ms, 3),
                "queue_ms": round(metrics.queue_ms, 3),
                "prefill_ms": round(metrics.prefill_ms, 3),
                "ttft_ms": round(metrics.ttft_ms, 3),
                "cached_prompt_tokens": metrics.cached_prompt_tokens,
                "cost": cost["total"],
                "cost_detail": cost,
                "dropped_params": list(prepared.dropped_params),
                "message_context": result.message_context,
            },
        )

    def engine_error(self, exc: Exception) -> APIError:
        if isinstance(exc, EngineError):
            self.metrics.upstream_errors.labels(str(exc.status_code)).inc()
            # An engine refusing for load is the documented overload answer: tell clients when to retry.
            retry = {"Retry-After": "1"} if exc.status_code in (429, 503) else None
            code = "overloaded" if retry else (getattr(exc, "code", None) or "engine_error")
            return APIError(exc.status_code, str(exc), param=getattr(exc, "param", None), code=code, headers=retry)
        if isinstance(exc, TimeoutError):
            self.metrics.upstream_errors.labels("504").inc()
            return APIError(504, str(exc) or "the request timed out", code="timeout")
        self.metrics.upstream_errors.labels("502").inc()
        logger.exception("model backend failed")
        return APIError(502, f"model backend failed: {exc.__class__.__name__}: {exc}", code="upstream_error")
