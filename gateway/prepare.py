"""Everything decided about a request before the model is called (`Prepared`): the model and the
policy, the fields, the quota check before any expensive work, the prompt, sampling, the reservation.

Chat, completions and `/v1/ctxgate/compress` run these steps in this order (compress stops at the
prompt); each route only parses the body and answers.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ctxgate.backend.engine.api import Priority
from ctxgate.backend.openai_api.errors import APIError
from ctxgate.backend.openai_api.request_params import EngineAsks, engine_asks
from ctxgate.compression.types import CompressionResult
from ctxgate.gateway.access import Access
from ctxgate.gateway.accounting import Accounting, fit_limit_of
from ctxgate.gateway.adaptive_budget import AdaptiveBudget
from ctxgate.gateway.budget_control import Decision
from ctxgate.gateway.early_checks import output_token_bound
from ctxgate.gateway.fit import Fit, FitLimit, FitRefused, fit_into
from ctxgate.gateway.keys import Tenant
from ctxgate.gateway.metrics import GatewayMetrics
from ctxgate.gateway.policy_resolution import PolicyResolver
from ctxgate.gateway.prepared import Compressed, Prepared
from ctxgate.gateway.prompt_building import PromptBuilder
from ctxgate.gateway.quota import Reservation
from ctxgate.gateway.request_fields import RequestFields
from ctxgate.gateway.request_id import received_at
from ctxgate.gateway.schemas import ChatCompletionRequest, CompletionRequest
from ctxgate.policies.schema import Policy


def _quota_floor_refusal(fit: Fit, exc: APIError) -> APIError:
    """A request fitted into its quota whose system prompt and question alone exceed the fitted budget:
    refused as the quota would have refused it, saying what it would have needed."""
    limit = "spend" if fit.bound_by == "spend" else "quota"
    return APIError(
        429,
        f"the tenant's {limit} leaves a prompt budget of {fit.budget} tokens (the request would have needed "
        f"{fit.would_have_needed} with its output): {exc.message}",
        code=fit.reason,
        error_type="rate_limit_error",
        headers={"Retry-After": str(fit.retry_after_s)},
    )


def _quota_fit_may_help(exc: APIError, policy: Policy) -> bool:
    limit = fit_limit_of(exc.code or "")
    return exc.status_code == 429 and limit is not None and policy.fit.action(limit) == "compress"


# Fitted again at most this many times when other requests take the room first (`_refitting`).
_REFITS = 8
Result = TypeVar("Result")


class _RoomTaken(Exception):
    """The exact reservation was refused by a token or spend limit the policy fits into: other
    requests took the room this one was sized for."""

    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True)
class _ChatRequest:
    """What a chat request's preparation settled before its prompt (kept for a second, fitted try)."""

    body: ChatCompletionRequest
    tenant: Tenant
    request_id: str
    arrived: float
    dropped: list[str]
    forward: dict[str, Any] | None
    choices: int
    asks: EngineAsks | None
    budget: Decision | None


class Preparation:
    def __init__(
        self,
        access: Access,
        resolver: PolicyResolver,
        accounting: Accounting,
        budget: AdaptiveBudget,
        fields: RequestFields,
        prompts: PromptBuilder,
        tokenizer: Any,
        metrics: GatewayMetrics,
    ):
        self.access = access
        self.resolver = resolver
        self.accounting = accounting
        self.budget = budget
        self.fields = fields
        self.prompts = prompts
        # The gateway's own tokenizer: what guided decoding compiles grammars against (built-in engine).
        self.tokenizer = tokenizer
        self.metrics = metrics

    def _policy(self, body: ChatCompletionRequest, tenant: Tenant) -> Policy:
        """The first steps of a preparation: the model this tenant may use, the policy it runs under."""
        self.access.check_model(body.model, tenant)
        return self.resolver.resolve(tenant, body.ctxgate, body.model)

    async def _prompt(
        self,
        body: ChatCompletionRequest,
        tenant: Tenant,
        policy: Policy,
        fit: Fit | None,
        tools: list[dict[str, Any]] | None = None,
        forward: dict[str, Any] | None = None,
    ) -> tuple[CompressionResult, list[int], str, Policy, Fit | None]:
        """The messages compressed to the policy's budget (fitted into a limit where the policy says
        so), then rendered and counted as they will be sent; with the policy they ran under."""
        result, policy, fit = await self._compressed(body, tenant, policy, fit)
        token_ids, prompt_text = self.prompts.encode_checked(result, policy, tools, body.model, forward)
        return result, token_ids, prompt_text, policy, fit

    async def _compressed(
        self, body: ChatCompletionRequest, tenant: Tenant, policy: Policy, fit: Fit | None
    ) -> tuple[CompressionResult, Policy, Fit | None]:
        try:
            return await self.prompts.compress(body, tenant, policy), policy, fit
        except APIError as exc:
            if exc.code != "prompt_too_long":
                raise
            if fit is not None:  # fitted into the quota, the parts never cut did not fit the budget
                self.metrics.fit_requests.labels(policy.name, fit.bound_by, "refused").inc()
                raise _quota_floor_refusal(fit, exc) from None
            limit = self._input_limit(policy, body.model)
            if policy.compression_enabled or policy.fit.action(limit) != "compress":
                self.metrics.fit_requests.labels(policy.name, limit, "refused").inc()
                raise
        fit = self._input_fit(body, policy, limit)
        try:
            result = await self.prompts.compress(body, tenant, fit.apply(policy))
        except APIError:
            self.metrics.fit_requests.labels(policy.name, limit, "refused").inc()
            raise
        return (
            result,
            fit.apply(policy),
            dataclasses.replace(fit, would_have_needed=result.original_prompt_tokens),
        )

    def _input_limit(self, policy: Policy, model: str | None) -> FitLimit:
        """Which limit set the budget: the model's window where it capped the policy's (fit_to_model)."""
        window = self.access.engine_for(model).max_model_len
        return "context_window" if policy.max_input_tokens >= window - 1 else "max_input_tokens"

    def _input_fit(self, body: ChatCompletionRequest, policy: Policy, limit: FitLimit) -> Fit:
        """A prompt over an input limit, compressed into it: under max_input_tokens, the budget itself;
        in the model's window, what the output reservation leaves (or the floor, output capped)."""
        output = output_token_bound(body, policy, 1)
        if limit == "max_input_tokens":
            return Fit(limit, policy.max_input_tokens, output, policy.max_input_tokens + 1)
        window = self.access.engine_for(body.model).max_model_len
        try:
            fitted = fit_into(policy.fit, limit, window, window, output, 1)
        except FitRefused as exc:
            raise APIError(413, str(exc), code="prompt_too_long") from None
        assert fitted is not None  # a prompt of a whole window and any output never fits it
        return fitted

    async def compress(self, body: ChatCompletionRequest, tenant: Tenant) -> Compressed:
        """`/v1/ctxgate/compress`: chat's steps up to its prompt. Nothing is generated, so the fields and
        sampling do not apply, and neither the quota check nor the reservation counts any output."""
        policy = self._policy(body, tenant)
        fit = await self.accounting.check_quota_first(tenant, policy, body, choices=0)

        async def attempt(fit: Fit | None) -> Compressed:
            result, _, _, fitted_policy, fit = await self._prompt(
                body, tenant, fit.apply(policy) if fit else policy, fit
            )
            # Metered like a request that generates nothing: one request, its prompt tokens.
            reservation = await self._reserve_fitted(
                fit,
                fitted_policy,
                self.accounting.reserve(tenant, fitted_policy, result.prompt_tokens, 0, model=body.model),
            )
            return Compressed(fitted_policy, result, reservation.rate_limits, fit)

        return await self._refitting(attempt, tenant, policy, body, 0, fit)

    async def chat(
        self, body: ChatCompletionRequest, tenant: Tenant, raw: dict[str, Any] | None = None
    ) -> Prepared:
        arrived = received_at()
        policy = self._policy(body, tenant)
        dropped, forward = self.fields.check_fields(body, policy, raw)
        choices = self.fields.choices_for(body, forward)
        # Before the grammar and the compression: a request the quota cannot take costs nothing.
        fit = await self.accounting.check_quota_first(tenant, policy, body, choices)
        asks = None if forward is not None else await engine_asks(body, self.tokenizer, tenant.name)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        policy, budget = self.budget.adapt(policy, request_id)
        request = _ChatRequest(body, tenant, request_id, arrived, dropped, forward, choices, asks, budget)
        try:
            # After the adaptive budget: a fit only ever lowers it.
            return await self._refitting(
                lambda fit: self._chat_prepared(request, fit.apply(policy) if fit else policy, fit),
                tenant,
                policy,
                body,
                choices,
                fit,
            )
        except BaseException:
            self.budget.controller.forget(request_id)
            raise

    async def _refitting(
        self,
        attempt: Callable[[Fit | None], Awaitable[Result]],
        tenant: Tenant,
        policy: Policy,
        body: ChatCompletionRequest,
        choices: int,
        fit: Fit | None,
    ) -> Result:
        """`attempt(fit)`; while its exact reservation finds that other requests took the room first
        (between the early check and it), `attempt` again fitted into what is left now. Each loss is
        another request's admission, so the room only shrinks until it fits or is under the floor."""
        refused: APIError | None = None
        for _ in range(_REFITS):
            try:
                return await attempt(fit)
            except _RoomTaken as taken:
                refused = taken.error
            retry_after = int(refused.headers.get("Retry-After", "1"))
            fit = await self.accounting.fit_quota(
                tenant, policy, body, choices, (refused.code or "", retry_after)
            )
        assert refused is not None
        self.metrics.fit_requests.labels(
            policy.name, fit_limit_of(refused.code or "") or "quota", "refused"
        ).inc()
        raise refused

    async def _chat_prepared(self, request: _ChatRequest, policy: Policy, fit: Fit | None) -> Prepared:
        """The prompt, the sampling and the exact reservation of a chat request under `policy`."""
        body, tenant, asks = request.body, request.tenant, request.asks
        tools = asks.output.tools.template_tools() if asks and asks.output.tools else None
        result, token_ids, prompt_text, policy, fit = await self._prompt(
            body, tenant, policy, fit, tools, request.forward
        )
        sampling = self.fields.sampling_for(body, policy, result.prompt_tokens, asks)
        priority = (
            Priority.BACKGROUND if body.ctxgate and body.ctxgate.priority == "background" else Priority.USER
        )
        prepared = Prepared(
            request_id=request.request_id,
            tenant=tenant,
            policy=policy,
            result=result,
            prompt_token_ids=token_ids,
            prompt_text=prompt_text,
            sampling=sampling,
            priority=priority,
            dropped_params=request.dropped,
            forward=request.forward,
            choices=request.choices,
            asks=asks,
            budget=request.budget,
            fit=fit,
            route_key=self.access.route_key(
                body.model, tenant, result.messages, None, self.prompts.conversation_key(body, tenant, policy)
            ),
            received_at=request.arrived,
        )
        prepared.reservation = await self._reserve_fitted(
            fit,
            policy,
            self.accounting.reserve(
                tenant,
                policy,
                result.prompt_tokens,
                sampling.max_tokens * request.choices,
                slot_id=request.request_id,
                model=body.model,
            ),
        )
        return prepared

    async def _reserve_fitted(
        self, fit: Fit | None, policy: Policy, reserve: Awaitable[Reservation]
    ) -> Reservation:
        """The exact reservation; a fitted request is counted fitted once it holds one. A refusal by a
        limit the policy fits into is `_RoomTaken` (`_refitting` fits the request again)."""
        try:
            reservation = await reserve
        except APIError as exc:
            if _quota_fit_may_help(exc, policy):
                raise _RoomTaken(exc) from None
            if fit is not None:
                self.metrics.fit_requests.labels(policy.name, fit.bound_by, "refused").inc()
            raise
        if fit is not None:
            self.metrics.fit_requests.labels(policy.name, fit.bound_by, "fitted").inc()
        return reservation

    def _raw_prompt_too_long(self, policy: Policy, tokens: str) -> APIError:
        self.metrics.budget_rejections.labels(policy.name).inc()
        return APIError(
            413,
            f"the prompt has {tokens} tokens; policy '{policy.name}' allows "
            f"{policy.max_input_tokens} (raw prompts are never cut)",
            param="prompt",
            code="prompt_too_long",
        )

    async def completion(
        self, body: CompletionRequest, tenant: Tenant, raw: dict[str, Any] | None = None
    ) -> Prepared:
        arrived = received_at()
        self.access.check_model(body.model, tenant)
        if body.ctxgate and (body.ctxgate.documents or body.ctxgate.retrieval):
            raise APIError(400, "documents and retrieval need /v1/chat/completions", param="ctxgate")
        policy = self.resolver.resolve(tenant, body.ctxgate, body.model)
        dropped, forward = self.fields.check_fields(body, policy, raw)
        choices = self.fields.choices_for(body, forward)
        # Before the grammar and tokenizing the prompt. Raw prompts are never cut, so a quota fit is not
        # applied: the exact reservation below refuses what the tokens left cannot hold.
        await self.accounting.check_quota_first(tenant, policy, body, choices)
        asks = None if forward is not None else await engine_asks(body, self.tokenizer, tenant.name)
        prompt_text = body.prompt_text() or ""
        least = self.prompts.least_prompt_tokens(prompt_text, body.model)
        if least > policy.max_input_tokens:
            raise self._raw_prompt_too_long(policy, f"at least {least}")
        token_ids = await self.prompts.encode_prompt(prompt_text, body.model)
        if not token_ids:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        if len(token_ids) > policy.max_input_tokens:
            raise self._raw_prompt_too_long(policy, str(len(token_ids)))
        result = CompressionResult(
            messages=[], original_prompt_tokens=len(token_ids), prompt_tokens=len(token_ids), stages=[]
        )
        sampling = self.fields.sampling_for(body, policy, len(token_ids), asks)
        prepared = Prepared(
            request_id=f"cmpl-{uuid.uuid4().hex}",
            tenant=tenant,
            policy=policy,
            result=result,
            prompt_token_ids=token_ids,
            prompt_text=prompt_text,
            sampling=sampling,
            priority=Priority.USER,
            dropped_params=dropped,
            forward=forward,
            choices=choices,
            asks=asks,
            route_key=self.access.route_key(body.model, tenant, None, prompt_text),
            received_at=arrived,
        )
        prepared.reservation = await self.accounting.reserve(
            tenant,
            policy,
            len(token_ids),
            sampling.max_tokens * choices,
            slot_id=prepared.request_id,
            model=body.model,
        )
        return prepared
