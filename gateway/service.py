"""Request orchestration, independent of HTTP: auth, policy, budget, quota, accounting.

The routes in `ctxgate.gateway.app` parse and respond; everything that decides something lives here.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ctxgate.backend.engine.api import EngineClient, EngineError, Priority, RequestMetrics, SamplingParams
from ctxgate.backend.engine.deltas import DeltaTotals
from ctxgate.backend.openai_api.errors import APIError, generic_server_error
from ctxgate.backend.openai_api.fields import enforce_supported
from ctxgate.backend.openai_api.request_params import EngineAsks, engine_asks
from ctxgate.backend.openai_api.responses import Usage
from ctxgate.backend.platform.bounded_encode import TextNotTokenizable
from ctxgate.backend.routing.model_router import ModelRouter
from ctxgate.backend.routing.upstream import UpstreamRefused
from ctxgate.compression.counting import CachedCounter
from ctxgate.compression.store.index_names import InvalidIndexName, UnknownIndexError, check_index_name
from ctxgate.compression.types import (
    BudgetExceededError,
    CompressionInput,
    CompressionResult,
    Document,
    RetrievalSpec,
)
from ctxgate.gateway.affinity import affinity_key
from ctxgate.gateway.budget_control import BudgetController, Decision, Outcome
from ctxgate.gateway.early_checks import output_token_bound, prompt_token_bound
from ctxgate.gateway.engine_load import reader_for
from ctxgate.gateway.forwarding import forwarded_fields, forwarded_prompt_tokens
from ctxgate.gateway.keys import KeyRejected, KeyStore, Tenant
from ctxgate.gateway.metrics import GatewayMetrics
from ctxgate.gateway.quota import (
    SPEND_SCALE,
    QuotaExceeded,
    QuotaLimits,
    QuotaStore,
    Reservation,
    StoreUnavailable,
)
from ctxgate.gateway.request_id import current_request, note_tenant, received_at
from ctxgate.gateway.schemas import ChatCompletionRequest, CompletionRequest, CtxgateExtras, GatewayRequest
from ctxgate.gateway.settings import GatewaySettings
from ctxgate.gateway.tokenizer_per_model import load_model_tokenizers
from ctxgate.policies.loader import PolicyRegistry, apply_overrides
from ctxgate.policies.schema import CostPolicy, Policy

logger = logging.getLogger(__name__)
# Most sequences one upstream request may make (`n`, `best_of`), as OpenAI's own limit on `n`.
MAX_CHOICES = 128
_TOOL_FIELDS = ("tool_calls", "tool_call_id")


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
    # perf_counter when the request reached the gateway (before its body was read and compressed),
    # and when its first token came back: the gateway's TTFT, which the budget controller learns from.
    received_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))


class Pipeline(Protocol):
    """What the gateway needs of a compressor (ctxgate.compression.pipeline.CompressionPipeline is the one)."""

    async def run(self, inp: CompressionInput, policy: Policy,
                  prepare: Callable[[CompressionInput], CompressionInput] | None = None,
                  counter: CachedCounter | None = None) -> CompressionResult:
        """`counter`: what the request's model is counted with (None: the pipeline's own tokenizer)."""
        ...

    def warm_up(self, stopping: threading.Event) -> int:
        """Load the models compression needs and run them once per shape they will meet, so the first
        requests pay for neither; ends early once `stopping` is set. Returns the calls run."""
        ...

    def observe_prefill(self, prompt_tokens: int, prefill_ms: float) -> None:
        """What a prefill of this size cost the engine: compression weighs its own cost against it."""
        ...

    def close(self) -> None: ...


def _index_not_found(name: str) -> APIError:
    return APIError(404, f"retrieval index '{name}' not found", param="ctxgate.retrieval.index",
                    code="index_not_found")


def quota_cap(home: Policy, policy: Policy) -> QuotaLimits:
    """What the request's policy adds to a tenant's limits. Another policy's whole quota caps them;
    the home policy's own quota is already the base (which the keys file may raise), so there only
    fields a request override changed cap them."""
    fields = policy.quota.model_dump()
    if policy.name == home.name:
        own = home.quota.model_dump()
        fields = {name: value for name, value in fields.items() if value != own.get(name)}
    return QuotaLimits.from_mapping(fields)


def tenant_prices(home: CostPolicy, requested: CostPolicy) -> CostPolicy:
    """The tenant's prices (its home policy's); a requested policy may raise a price, never lower
    it. Prices in another currency cannot be compared, so the tenant's own stand then."""
    if requested.currency != home.currency:
        return home
    return home.model_copy(update={"prompt_per_1k": max(home.prompt_per_1k, requested.prompt_per_1k),
                                   "completion_per_1k": max(home.completion_per_1k, requested.completion_per_1k)})


def compression_figures(result: CompressionResult) -> dict[str, Any]:
    """What a compression saved and cost, as `usage.ctxgate` and the compress report show it."""
    return {
        "original_prompt_tokens": result.original_prompt_tokens,
        "prompt_tokens": result.prompt_tokens,
        "saved_tokens": result.saved_tokens,
        "compression_ms": result.compression_ms,
        "compression_wait_ms": round(result.wait_ms, 3),
        "compression_engine_ms": round(result.engine_ms, 3),
    }


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
        # A model list: each served name's own group (its context length, whether it forwards fields).
        self.models: dict[str, EngineClient] = dict(engine.groups) if isinstance(engine, ModelRouter) else {}
        self._prefix_chars = {model.model_name: model.affinity_prefix_chars for model in settings.model_list}
        # Each served model's tokenizer (model_list[].tokenizer, else this one) and neutraliser. Upstream
        # mode: the serving model's tokens (from --tokenizer) plus the common templates' ones.
        self.tokens = load_model_tokenizers(tokenizer, engine.forwards_fields, list(settings.model_list))
        self.neutraliser = self.tokens.default.neutraliser
        # Keys each tenant's prefix-cache salt; random per process unless configured (replicas that
        # share an upstream should share it, or they never share cached prefixes).
        secret = settings.cache_salt_secret or secrets.token_hex(32)
        self._salt_key = secret.encode()
        self.budgets = BudgetController(reader_for(engine))

    def cache_salt(self, tenant: str) -> str:
        """The tenant's prefix-cache namespace: HMAC-SHA256 of its name under the server secret, so
        no client can name (or guess) another tenant's salt."""
        return hmac.new(self._salt_key, tenant.encode(), hashlib.sha256).hexdigest()

    # -- identity and policy -------------------------------------------------------------------
    def engine_for(self, model: str | None) -> EngineClient:
        """The engine serving this model name (the one engine without a model list)."""
        return self.models.get(model or "", self.engine)

    def route_key(self, model: str, tenant: Tenant, messages: list[dict[str, Any]] | None,
                  prompt_text: str | None) -> str | None:
        """The cache-affinity key of a request for a model-list model (None otherwise)."""
        if model not in self._prefix_chars:
            return None
        return affinity_key(self.cache_salt(tenant.name), messages, prompt_text, self._prefix_chars[model])

    @property
    def model_names(self) -> list[str]:
        if self.models:
            return list(self.models)
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

    def allowed_models(self, tenant: Tenant | None) -> list[str]:
        """The served model names this tenant's key may use."""
        allowed = tenant.key.models if tenant is not None and tenant.key is not None else None
        return [name for name in self.model_names if allowed is None or name in allowed]

    def check_model(self, model: str, tenant: Tenant | None = None) -> None:
        if model not in self.model_names:
            raise APIError(
                404, f"model '{model}' is not served here (available: {', '.join(self.allowed_models(tenant))})",
                param="model", code="model_not_found",
            )
        allowed = tenant.key.models if tenant is not None and tenant.key is not None else None
        if allowed is not None and model not in allowed:
            raise APIError(
                403, f"API key {tenant.key.key_id} may not use model '{model}' (allowed: {', '.join(allowed)})",
                param="model", code="model_not_allowed", error_type="permission_error",
            )

    # -- what a tenant may use -----------------------------------------------------------------
    def home_policy_name(self, tenant: Tenant) -> str:
        """The policy a tenant's requests get when they name none; its quota and prices are the tenant's."""
        return tenant.policy or self.settings.default_policy

    def allowed_policies(self, tenant: Tenant) -> tuple[str, ...] | None:
        """Policy names this tenant may name (its home policy first); None: any (open mode)."""
        if not tenant.bounded:
            return None
        return tuple(dict.fromkeys((self.home_policy_name(tenant), *(tenant.policies or ()))))

    def _check_policy_allowed(self, tenant: Tenant, name: str) -> None:
        allowed = self.allowed_policies(tenant)
        if allowed is None or name in allowed:
            return
        # Checked before the policy is looked up: the answer does not tell whether it exists.
        who = f"API key {tenant.key.key_id}" if tenant.key is not None else f"tenant '{tenant.name}'"
        raise APIError(403, f"{who} may not use policy '{name}' (it may use: {', '.join(allowed)})",
                       param="ctxgate.policy", code="policy_not_allowed", error_type="permission_error")

    def check_index(self, tenant: Tenant, name: str) -> None:
        """A well-formed name (400 otherwise) that this tenant may search. An index it may not use is
        the same 404 as one that does not exist, so a key cannot learn other tenants' index names."""
        try:
            check_index_name(name)
        except InvalidIndexName as exc:
            raise APIError(400, str(exc), param="ctxgate.retrieval.index", code="invalid_index_name") from None
        if tenant.indexes is not None and name not in tenant.indexes:
            raise _index_not_found(name)

    def resolve_policy(self, tenant: Tenant, extras: CtxgateExtras | None, model: str | None = None) -> Policy:
        requested = extras.policy if extras else None
        home_name = self.home_policy_name(tenant)
        name = requested or home_name
        if requested:
            self._check_policy_allowed(tenant, requested)
        policy = self.policies.get(name)
        if policy is None:
            allowed = self.allowed_policies(tenant)
            available = [n for n in self.policies.names() if allowed is None or n in allowed]
            raise APIError(
                400 if requested else 503,
                f"unknown policy '{name}' (available: {', '.join(available) or 'none'})",
                param="ctxgate.policy" if requested else None, code="policy_not_found",
            )
        home = self._home_policy(tenant)
        if extras and extras.overrides:
            try:
                policy = apply_overrides(policy, extras.overrides)
            except ValueError as exc:
                raise APIError(400, str(exc), param="ctxgate.overrides", code="override_not_allowed") from None
        if home is not None:
            policy = policy.model_copy(update={"cost": tenant_prices(home.cost, policy.cost)})
        return self.fit_to_model(policy, model)

    def _home_policy(self, tenant: Tenant) -> Policy | None:
        """A bounded tenant's home policy (its quota and prices); None in open mode, where the
        requested policy's own apply. A bounded tenant whose home policy is not loaded is refused:
        there would be nothing to hold it to."""
        if not tenant.bounded:
            return None
        home = self.policies.get(self.home_policy_name(tenant))
        if home is None:
            logger.error("policy '%s' of tenant %s is not loaded", self.home_policy_name(tenant), tenant.name)
            raise APIError(503, "this key's policy is not available; try again later", code="policy_not_found",
                           headers={"Retry-After": "1"})
        return home

    def fit_to_model(self, policy: Policy, model: str | None = None) -> Policy:
        """Cap the input budget at what the model can hold with at least one output token."""
        limit = self.engine_for(model).max_model_len - 1
        if policy.max_input_tokens <= limit:
            return policy
        return policy.model_copy(update={"max_input_tokens": limit})

    # -- request fields --------------------------------------------------------------------------
    @property
    def forwards_fields(self) -> bool:
        """Upstream mode: the engine sends the client's fields on instead of honouring them itself."""
        return self.engine.forwards_fields

    def check_fields(self, body: GatewayRequest, policy: Policy,
                     raw: dict[str, Any] | None) -> tuple[list[str], dict[str, Any] | None]:
        """(dropped field names, fields to forward). The built-in engine refuses (400) what it cannot
        honour unless drop_params; an upstream gets the allow-listed part of the client's body
        (`ctxgate.gateway.forwarding`), the rest dropped and named."""
        if self.engine_for(body.model).forwards_fields:
            fields = dict(raw) if raw is not None else body.model_dump(exclude_unset=True)
            forwarded = forwarded_fields(fields, isinstance(body, ChatCompletionRequest),
                                         self.tokens.for_model(body.model).neutraliser)
            return forwarded.dropped, forwarded.fields
        return enforce_supported(body, policy.drop_params or self.settings.drop_params), None

    def choices_for(self, body: GatewayRequest, forward: dict[str, Any] | None) -> int:
        """How many sequences the request makes, each up to max_tokens, all of them reserved: the
        built-in engine makes n; an upstream makes max(n, best_of)."""
        best_of = forward.get("best_of") if forward is not None else None
        if best_of is not None and (isinstance(best_of, bool) or not isinstance(best_of, int) or best_of < 1):
            raise APIError(400, "best_of must be a positive integer", param="best_of", code="invalid_value")
        choices = max(body.n, best_of or 1)
        if choices > MAX_CHOICES:
            field = "n" if body.n >= (best_of or 1) else "best_of"
            raise APIError(400, f"{field} may be at most {MAX_CHOICES} (each choice is reserved against the quota)",
                           param=field, code="unsupported_parameter")
        return choices

    # -- budget --------------------------------------------------------------------------------
    async def compress(self, body: ChatCompletionRequest, tenant: Tenant, policy: Policy) -> CompressionResult:
        # Client text may not forge control tokens or context markers (gateway/sanitize.py). An
        # upstream also gets each message's other fields (tool_calls, tool_call_id, ...) back.
        # The neutraliser reads the whole request's text: it runs with the compression, off this loop.
        # The built-in engine renders tool-call turns and tool results itself: those fields stay too.
        extra_fields = self.forwards_fields
        messages = [{"role": m.role, "content": m.text()}
                    | ({"name": m.name} if m.name else {})
                    | {k: v for k, v in (m.model_extra or {}).items() if extra_fields or k in _TOOL_FIELDS}
                    for m in body.messages]
        extras = body.ctxgate or CtxgateExtras()
        documents = [
            Document(text=d.text, id=None if d.id is None else str(d.id), title=d.title, score=d.score)
            for d in extras.documents or []
        ]
        if extras.retrieval:
            self.check_index(tenant, extras.retrieval.index)
        retrieval = RetrievalSpec(extras.retrieval.index, extras.retrieval.top_n) if extras.retrieval else None
        # Passages from an index are as untrusted as the client's documents: neutralised the same way.
        tokens = self.tokens.for_model(body.model)
        inp = CompressionInput(messages=messages, documents=documents, retrieval=retrieval, tenant=tenant.name,
                               neutralise=tokens.neutraliser.document)
        try:
            result = await self.pipeline.run(inp, policy, prepare=tokens.neutraliser.compression_input,
                                             counter=tokens.counter)
        except BudgetExceededError as exc:
            self.metrics.budget_rejections.labels(policy.name).inc()
            raise APIError(413, str(exc), param="messages", code="prompt_too_long") from None
        except UnknownIndexError:
            raise _index_not_found(retrieval.index if retrieval else "") from None
        except TextNotTokenizable:  # the library's own text (regex internals) stays in the log
            logger.warning("compression input refused by the tokenizer", exc_info=True)
            raise APIError(400, "a message or document could not be tokenized", param="messages",
                           code="invalid_value") from None
        except OSError:  # a server file (an index's parts, a model): its path stays in the log
            logger.exception("compression failed on a server file")
            raise APIError(500, "the request could not be processed; the server log has the details",
                           code="internal_error") from None
        except (ValueError, KeyError) as exc:
            raise APIError(400, str(exc), code="invalid_request") from None
        for stage in result.stages:
            self.metrics.compression_seconds.labels(stage.name).observe(stage.ms / 1000)
        if policy.compression_enabled:
            self.metrics.compression_wait_seconds.observe(result.wait_ms / 1000)
        return result

    def encode_checked(self, result: CompressionResult, policy: Policy, tools: list[dict[str, Any]] | None = None,
                       model: str | None = None, forward: dict[str, Any] | None = None) -> tuple[list[int], str]:
        """Token ids actually sent (with `model`'s tokenizer); re-counted here so the budget holds
        whatever pipeline ran. `forward`: an upstream's fields, whose `tools` and `documents` its
        template adds to the prompt: counted in `result.prompt_tokens` too."""
        tokens = self.tokens.for_model(model)
        # Tools are client text the template prints: inert like the messages (which the pipeline cleaned).
        prompt_text = tokens.tokenizer.render_chat(result.messages, tools=tokens.neutraliser.value(tools) if tools else None)
        token_ids = tokens.tokenizer.encode(prompt_text)
        if len(token_ids) > policy.max_input_tokens:
            logger.error("pipeline produced %d tokens over budget %d", len(token_ids), policy.max_input_tokens)
            raise APIError(
                413, f"the prompt needs {len(token_ids)} tokens; policy '{policy.name}' allows "
                f"{policy.max_input_tokens}", code="prompt_too_long",
            )
        prompt_tokens = len(token_ids) + forwarded_prompt_tokens(forward, tokens.tokenizer)
        if prompt_tokens > policy.max_input_tokens:
            raise APIError(
                413, f"the prompt with its tools and documents needs {prompt_tokens} tokens; policy "
                f"'{policy.name}' allows {policy.max_input_tokens}", code="prompt_too_long",
                param="tools" if forward and forward.get("tools") else "documents",
            )
        result.prompt_tokens = prompt_tokens
        return token_ids, prompt_text

    async def encode_prompt(self, text: str, model: str | None) -> list[int]:
        """A raw prompt's ids, tokenized off the event loop (megabytes take a second; /health must not wait)."""
        tokenizer = self.tokens.for_model(model).tokenizer
        try:
            return await asyncio.to_thread(tokenizer.encode, text)
        except TextNotTokenizable:
            logger.warning("prompt refused by the tokenizer", exc_info=True)
            raise APIError(400, "prompt could not be tokenized", param="prompt", code="invalid_value") from None

    def sampling_for(self, body: GatewayRequest, policy: Policy, prompt_tokens: int,
                     asks: EngineAsks | None = None) -> SamplingParams:
        requested = body.requested_max_tokens()
        room = self.engine_for(body.model).max_model_len - prompt_tokens
        max_tokens = min(requested or policy.reserve_output_tokens, policy.reserve_output_tokens, room)
        if max_tokens < 1:
            raise APIError(413, "the prompt leaves no room for output in the model's context", code="prompt_too_long")
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
            seed=body.seed, stop=body.stop_list(), stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos, min_tokens=min(body.min_tokens, max_tokens),
            **(asks.sampling if asks else {}),
        )
        try:
            sampling.validate()
        except ValueError as exc:
            raise APIError(400, str(exc), param=getattr(exc, "param", None), code="invalid_value") from None
        return sampling

    def adapt_budget(self, policy: Policy, request_id: str) -> tuple[Policy, Decision | None]:
        """An adaptive policy with its documents budget chosen for the engine's load now."""
        if not policy.adaptive.enabled or not policy.compression_enabled:
            return policy, None
        decision = self.budgets.decide(request_id, policy.name, policy.adaptive, policy.documents.max_tokens)
        self.metrics.adaptive_budget_tokens.labels(policy.name).observe(decision.budget)
        self.metrics.adaptive_decisions.labels(policy.name, decision.reason).inc()
        documents = policy.documents.model_copy(update={"max_tokens": min(decision.budget, policy.max_input_tokens)})
        return policy.model_copy(update={"documents": documents}), decision

    def budget_outcome(self, prepared: Prepared, metrics: RequestMetrics | None) -> dict[str, Any] | None:
        """`usage.ctxgate.budget`, and what the controller learns from the request."""
        decision = prepared.budget
        if decision is None:
            return None
        if metrics is None or metrics.ttft_ms <= 0:  # no first token: nothing measured
            self.budgets.forget(prepared.request_id)
            return decision.to_dict()
        result, slo = prepared.result, prepared.policy.adaptive.ttft_slo_s
        compression_s = (sum(result.compression_ms.values()) + result.wait_ms) / 1000
        # The gateway's TTFT, from the request's arrival: reading, compressing, tokenizing and the
        # engine's queue and prefill (the sum of the parts when no first token was timed here).
        if prepared.first_token_at is not None:
            ttft_s = prepared.first_token_at - prepared.received_at
        else:
            ttft_s = compression_s + metrics.ttft_ms / 1000
        self.budgets.observe(prepared.request_id, decision.budget,
                             Outcome(ttft_s, compression_s, result.prompt_tokens, metrics.prefill_ms))
        met = ttft_s <= slo
        self.metrics.adaptive_slo_requests.labels(prepared.policy.name, str(met).lower()).inc()
        return decision.to_dict() | {"ttft_slo_s": slo, "measured_ttft_s": round(ttft_s, 4), "slo_met": met}

    # -- quota ---------------------------------------------------------------------------------
    def limits_for(self, tenant: Tenant, policy: Policy) -> QuotaLimits:
        """The tenant's limits: its keys-file quota over its home policy's, tightened by the policy
        the request runs under (which can never loosen them). Open mode: the request's policy."""
        home = self._home_policy(tenant)
        if home is None:
            return QuotaLimits.from_policy(policy.quota, tenant.quota_override)
        base = QuotaLimits.from_policy(home.quota, tenant.quota_override)
        return base.tightened_by(quota_cap(home, policy))

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
            raise self._quota_refusal(tenant, exc) from None
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

    def _quota_refusal(self, tenant: Tenant, exc: QuotaExceeded) -> APIError:
        self.metrics.quota_rejections.labels(tenant.name, exc.reason).inc()
        return APIError(429, str(exc), code=exc.reason, error_type="rate_limit_error",
                        headers={"Retry-After": str(exc.retry_after_s)})

    async def check_quota_first(self, tenant: Tenant, policy: Policy, body: GatewayRequest, choices: int) -> None:
        """429 before any expensive work (compression, grammar, tokenizing a large prompt) when the quota
        has no room for the request at its largest (gateway/early_checks.py); nothing is reserved. A
        store that cannot be reached is left to `reserve`, which applies on_store_error."""
        limits = self.limits_for(tenant, policy)
        key = tenant.key
        key_limits = QuotaLimits.from_mapping(key.limits) if key is not None and key.limits else None
        if limits.unlimited and key_limits is None:
            return
        prompt = prompt_token_bound(body, policy)
        output = output_token_bound(body, policy, choices)
        spend_micros = int(round(self.cost(policy, prompt, output)["total"] * SPEND_SCALE))
        try:
            await self.store.check(tenant.name, limits, prompt + output, spend_micros,
                                   key_id=key.quota_id if key_limits else None, key_limits=key_limits)
        except QuotaExceeded as exc:
            raise self._quota_refusal(tenant, exc) from None
        except StoreUnavailable:
            return

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
        self.budgets.forget(prepared.request_id)
        await self.reconcile(prepared.reservation, 0, 0.0)

    # -- the whole preparation -----------------------------------------------------------------
    async def prepare_chat(self, body: ChatCompletionRequest, tenant: Tenant,
                           raw: dict[str, Any] | None = None) -> Prepared:
        arrived = received_at()
        self.check_model(body.model, tenant)
        policy = self.resolve_policy(tenant, body.ctxgate, body.model)
        dropped, forward = self.check_fields(body, policy, raw)
        choices = self.choices_for(body, forward)
        await self.check_quota_first(tenant, policy, body, choices)  # before the grammar and compression
        asks = None if forward is not None else await engine_asks(body, self.tokenizer, tenant.name)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        policy, budget = self.adapt_budget(policy, request_id)
        try:
            result = await self.compress(body, tenant, policy)
            tools = asks.output.tools.template_tools() if asks and asks.output.tools else None
            token_ids, prompt_text = self.encode_checked(result, policy, tools, body.model, forward)
            sampling = self.sampling_for(body, policy, result.prompt_tokens, asks)
            priority = Priority.BACKGROUND if body.ctxgate and body.ctxgate.priority == "background" else Priority.USER
            prepared = Prepared(
                request_id=request_id, tenant=tenant, policy=policy, result=result,
                prompt_token_ids=token_ids, prompt_text=prompt_text, sampling=sampling, priority=priority,
                dropped_params=dropped, forward=forward, choices=choices, asks=asks, budget=budget,
                route_key=self.route_key(body.model, tenant, result.messages, None), received_at=arrived,
            )
            prepared.reservation = await self.reserve(tenant, policy, result.prompt_tokens,
                                                      sampling.max_tokens * choices, slot_id=prepared.request_id)
        except BaseException:
            self.budgets.forget(request_id)
            raise
        return prepared

    async def prepare_completion(self, body: CompletionRequest, tenant: Tenant,
                                 raw: dict[str, Any] | None = None) -> Prepared:
        arrived = received_at()
        self.check_model(body.model, tenant)
        if body.ctxgate and (body.ctxgate.documents or body.ctxgate.retrieval):
            raise APIError(400, "documents and retrieval need /v1/chat/completions", param="ctxgate")
        policy = self.resolve_policy(tenant, body.ctxgate, body.model)
        dropped, forward = self.check_fields(body, policy, raw)
        choices = self.choices_for(body, forward)
        await self.check_quota_first(tenant, policy, body, choices)  # before the grammar and tokenizing
        asks = None if forward is not None else await engine_asks(body, self.tokenizer, tenant.name)
        prompt_text = body.prompt_text() or ""
        token_ids = await self.encode_prompt(prompt_text, body.model)
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
        sampling = self.sampling_for(body, policy, len(token_ids), asks)
        prepared = Prepared(
            request_id=f"cmpl-{uuid.uuid4().hex}", tenant=tenant, policy=policy, result=result,
            prompt_token_ids=token_ids, prompt_text=prompt_text, sampling=sampling, priority=Priority.USER,
            dropped_params=dropped, forward=forward, choices=choices, asks=asks,
            route_key=self.route_key(body.model, tenant, None, prompt_text), received_at=arrived,
        )
        prepared.reservation = await self.reserve(tenant, policy, len(token_ids), sampling.max_tokens * choices,
                                                  slot_id=prepared.request_id)
        return prepared

    # -- after the model -----------------------------------------------------------------------
    async def settle(self, prepared: Prepared, totals: DeltaTotals, count_metrics: bool = True) -> Usage:
        """Reconcile the quota, record metrics, and return `usage` (with `usage.ctxgate`)."""
        policy, tenant, result = prepared.policy, prepared.tenant, prepared.result
        prompt_tokens = totals.prompt_tokens or result.prompt_tokens
        cost = self.cost(policy, prompt_tokens, totals.completion_tokens)
        await self.reconcile(prepared.reservation, prompt_tokens + totals.completion_tokens, cost["total"])
        if count_metrics:
            labels = (tenant.name, policy.name)
            self.metrics.prompt_tokens_original.labels(*labels).inc(result.original_prompt_tokens)
            self.metrics.prompt_tokens_sent.labels(*labels).inc(result.prompt_tokens)
            self.metrics.completion_tokens.labels(*labels).inc(totals.completion_tokens)
            for stage, saved in result.saved_tokens.items():
                self.metrics.saved_tokens.labels(stage, policy.name).inc(max(0, saved))
            if cost["total"] > 0:
                self.metrics.spend.labels(tenant.name, cost["currency"]).inc(cost["total"])
        metrics = totals.metrics or RequestMetrics()
        if metrics.prefill_ms > 0:
            # Measured prefill cost lets the pipeline skip compression that would not pay for itself.
            self.pipeline.observe_prefill(prompt_tokens, metrics.prefill_ms)
        budget = self.budget_outcome(prepared, totals.metrics)
        return Usage.of(
            prompt_tokens, totals.completion_tokens, metrics.cached_prompt_tokens,
            ctxgate={
                "tenant": tenant.name,
                "policy": policy.name,
                **compression_figures(result),
                "queue_ms": round(metrics.queue_ms, 3),
                "prefill_ms": round(metrics.prefill_ms, 3),
                "ttft_ms": round(metrics.ttft_ms, 3),
                "cached_prompt_tokens": metrics.cached_prompt_tokens,
                "cost": cost["total"],
                "cost_detail": cost,
                "dropped_params": list(prepared.dropped_params),
                "message_context": result.message_context,
            } | ({"budget": budget} if budget is not None else {}),
        )

    def engine_error(self, exc: Exception) -> APIError:
        """The client's answer for a failed generation. A 4xx from the engine is about the request and
        keeps its message; a 5xx says only what kind of failure and the request id, while the log gets
        the details (an upstream's URL, its error text), under that id."""
        context = current_request()
        request_id = context.request_id if context is not None else None
        if isinstance(exc, EngineError):
            self.metrics.upstream_errors.labels(str(exc.status_code)).inc()
            # An engine refusing for load is the documented overload answer: tell clients when to retry.
            retry = {"Retry-After": "1"} if exc.status_code in (429, 503) else None
            code = "overloaded" if retry else (exc.code or "engine_error")
            if isinstance(exc, UpstreamRefused):
                # The upstream's words (a traceback, a path, an internal URL) are for the log only.
                logger.warning("model backend refused (request id %s): %s", request_id, exc.detail)
                return APIError(exc.status_code, f"{exc} (request id {request_id})", param=exc.param, code=code,
                                headers=retry)
            if exc.status_code < 500:
                return APIError(exc.status_code, str(exc), param=exc.param, code=code,
                                headers=retry)
            logger.warning("model backend answered %d (request id %s): %s", exc.status_code, request_id, exc)
            return generic_server_error(exc.status_code, request_id, code=code, headers=retry)
        if isinstance(exc, TimeoutError):
            self.metrics.upstream_errors.labels("504").inc()
            logger.warning("request timed out (request id %s): %s", request_id, exc)
            return generic_server_error(504, request_id, code="timeout")
        self.metrics.upstream_errors.labels("502").inc()
        logger.error("model backend failed (request id %s)", request_id, exc_info=exc)
        return generic_server_error(502, request_id, code="upstream_error")
