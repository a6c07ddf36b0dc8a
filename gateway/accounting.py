"""A tenant's limits, the cost of a request, and the quota's life around one request: checked before
any expensive work, reserved for prompt plus maximum output, then reconciled with what ran (settled)
or given back (released), exactly once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ctxgate.backend.engine.api import RequestMetrics
from ctxgate.backend.engine.deltas import DeltaTotals
from ctxgate.backend.openai_api.errors import APIError
from ctxgate.backend.openai_api.responses import Usage
from ctxgate.gateway.adaptive_budget import AdaptiveBudget
from ctxgate.gateway.early_checks import output_token_bound, prompt_token_bound
from ctxgate.gateway.fit import TOKENS, Fit, FitLimit, FitRefused, Prices, fit_into
from ctxgate.gateway.keys import Tenant
from ctxgate.gateway.metrics import GatewayMetrics
from ctxgate.gateway.policy_resolution import PolicyResolver, quota_cap
from ctxgate.gateway.prepared import Prepared, compression_figures
from ctxgate.gateway.quota import (
    SPEND_SCALE,
    QuotaExceeded,
    QuotaLimits,
    QuotaStore,
    Reservation,
    StoreUnavailable,
)
from ctxgate.gateway.request_id import note_usage
from ctxgate.gateway.schemas import GatewayRequest
from ctxgate.gateway.segments import count_segments, segment_costs, usage_segments
from ctxgate.policies.schema import Policy

logger = logging.getLogger(__name__)
# The refusals compress-to-fit can answer (a smaller prompt cannot help a request limit): the
# tenant's or key's tokens (fit.quota) and spend (fit.spend).
QUOTA_TOKEN_REASONS = frozenset(
    {"tokens_per_minute", "tokens_per_day", "tokens_per_week", "tokens_per_month"}
)
QUOTA_SPEND_REASONS = frozenset({"spend_per_day", "budget"})


# How many times the room is read for one fit (see `Accounting.fit_quota`).
_FIT_READS = 4


def fit_limit_of(reason: str) -> FitLimit | None:
    """The fit limit a quota refusal's reason belongs to; None: fitting cannot help it."""
    if reason in QUOTA_TOKEN_REASONS:
        return "quota"
    return "spend" if reason in QUOTA_SPEND_REASONS else None


@dataclasses.dataclass(frozen=True)
class Scopes:
    """Whose limits a request meets: its tenant's, its key's (when the key has its own), for `model`."""

    limits: QuotaLimits
    key_id: str | None
    key_limits: QuotaLimits | None
    model: str | None


def cost(policy: Policy, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    prompt_cost = prompt_tokens / 1000 * policy.cost.prompt_per_1k
    completion_cost = completion_tokens / 1000 * policy.cost.completion_per_1k
    return {
        "prompt": round(prompt_cost, 8),
        "completion": round(completion_cost, 8),
        "total": round(prompt_cost + completion_cost, 8),
        "currency": policy.cost.currency,
    }


def priced(policy: Policy) -> bool:
    return policy.cost.prompt_per_1k > 0 or policy.cost.completion_per_1k > 0


class Accounting:
    def __init__(
        self,
        store: QuotaStore,
        metrics: GatewayMetrics,
        resolver: PolicyResolver,
        budget: AdaptiveBudget,
        observe_prefill: Callable[[int, float], None],
    ):
        self.store = store
        self.metrics = metrics
        self.resolver = resolver
        self.budget = budget
        # Measured prefill cost lets the compression pipeline skip work that would not pay for itself.
        self.observe_prefill = observe_prefill

    def limits_for(self, tenant: Tenant, policy: Policy) -> QuotaLimits:
        """The tenant's limits: its keys-file quota over its home policy's, tightened by the policy
        the request runs under (which can never loosen them). Open mode: the request's policy."""
        home = self.resolver.home_policy(tenant)
        if home is None:
            return QuotaLimits.from_policy(policy.quota, tenant.quota_override)
        base = QuotaLimits.from_policy(home.quota, tenant.quota_override)
        return base.tightened_by(quota_cap(home, policy))

    async def reserve(
        self,
        tenant: Tenant,
        policy: Policy,
        prompt_tokens: int,
        max_tokens: int,
        slot_id: str | None = None,
        model: str | None = None,
    ) -> Reservation:
        """Reserve against the tenant's limits and its key's, and either's for `model`. `slot_id`: hold
        a parallel-request slot until the request is settled (generation); without it a parallel limit
        is only checked."""
        scopes = self._scopes(tenant, policy, model)
        limits, key_limits = scopes.limits, scopes.key_limits
        tokens = prompt_tokens + max_tokens
        spend_micros = int(round(cost(policy, prompt_tokens, max_tokens)["total"] * SPEND_SCALE))
        if limits.unlimited and key_limits is None:
            return Reservation(tenant.name, tokens, spend_micros, recorded=False)
        try:
            reservation = await self.store.reserve(
                tenant.name,
                limits,
                tokens,
                spend_micros,
                key_id=scopes.key_id,
                key_limits=key_limits,
                slot_id=slot_id,
                model=model,
            )
        except QuotaExceeded as exc:
            raise self._quota_refusal(tenant, exc) from None
        except StoreUnavailable as exc:
            self.metrics.quota_store_up.set(0)
            action = limits.on_store_error
            self.metrics.quota_store_errors.labels(action).inc()
            logger.warning("%s; on_store_error=%s for tenant %s", exc, action, tenant.name)
            if action == "deny":
                raise APIError(
                    503,
                    "quota store unavailable and the policy denies requests it cannot account for",
                    code="quota_store_unavailable",
                    headers={"Retry-After": "1"},
                ) from None
            return Reservation(tenant.name, tokens, spend_micros, recorded=False)
        self.metrics.quota_store_up.set(1)
        return reservation

    def _quota_refusal(self, tenant: Tenant, exc: QuotaExceeded) -> APIError:
        self.metrics.quota_rejections.labels(tenant.name, exc.reason).inc()
        return APIError(
            429,
            str(exc),
            code=exc.reason,
            error_type="rate_limit_error",
            headers={"Retry-After": str(exc.retry_after_s)}
            | (exc.rate_limits.headers() if exc.rate_limits is not None else {}),
            details={"quota": exc.usage.report()} if exc.usage is not None else None,
        )

    async def check_quota_first(
        self, tenant: Tenant, policy: Policy, body: GatewayRequest, choices: int
    ) -> Fit | None:
        """429 before any expensive work (compression, grammar, tokenizing a large prompt) when the quota
        has no room for the request at its largest (gateway/early_checks.py); nothing is reserved. A
        store that cannot be reached is left to `reserve`, which applies on_store_error.

        Under `fit.quota: compress` (tokens) or `fit.spend: compress` (spend), a request the tokens or
        spend left cannot hold is fitted into them instead (the returned `Fit`, for `Fit.apply`),
        unless that leaves the prompt under the floor."""
        scopes = self._scopes(tenant, policy, body.model)
        if scopes.limits.unlimited and scopes.key_limits is None:
            return None
        prompt = prompt_token_bound(body, policy)
        output = output_token_bound(body, policy, choices)
        try:
            await self._check(tenant, scopes, policy, prompt, output)
            return None
        except QuotaExceeded as exc:
            limit = fit_limit_of(exc.reason)
            if limit is None:
                raise self._quota_refusal(tenant, exc) from None
            if policy.fit.action(limit) != "compress":
                self.metrics.fit_requests.labels(policy.name, limit, "refused").inc()
                raise self._quota_refusal(tenant, exc) from None
            refused = exc.reason, exc.retry_after_s
        except StoreUnavailable:
            return None
        return await self.fit_quota(tenant, policy, body, choices, refused)

    def _scopes(self, tenant: Tenant, policy: Policy, model: str | None) -> Scopes:
        """The tenant's limits, and its key's id and limits when the key has limits of its own."""
        limits = self.limits_for(tenant, policy)
        key = tenant.key
        if key is None or not key.limits:
            return Scopes(limits, None, None, model)
        # A key's window shape and zone are its tenant's unless it sets its own.
        return Scopes(limits, key.quota_id, QuotaLimits.from_mapping(key.limits, inherit=limits), model)

    async def _check(
        self,
        tenant: Tenant,
        scopes: Scopes,
        policy: Policy,
        prompt: int,
        output: int,
    ) -> None:
        spend_micros = int(round(cost(policy, prompt, output)["total"] * SPEND_SCALE))
        await self.store.check(
            tenant.name,
            scopes.limits,
            prompt + output,
            spend_micros,
            key_id=scopes.key_id,
            key_limits=scopes.key_limits,
            model=scopes.model,
        )

    async def _room(
        self, limit: FitLimit, tenant: Tenant, scopes: Scopes, policy: Policy
    ) -> tuple[int, Prices]:
        """What is left under `limit` now, and what a prompt and an output token take of it."""
        where = {"key_id": scopes.key_id, "key_limits": scopes.key_limits, "model": scopes.model}
        if limit == "spend":
            left = await self.store.spend_left(tenant.name, scopes.limits, **where)
            per_token = SPEND_SCALE / 1000
            prices = Prices(policy.cost.prompt_per_1k * per_token, policy.cost.completion_per_1k * per_token)
            # One micro-unit kept back: the reservation rounds the cost to micro-units.
            return max(0, (left or 0) - 1), prices
        left = await self.store.tokens_left(tenant.name, scopes.limits, **where)
        return left or 0, TOKENS

    async def fit_quota(
        self, tenant: Tenant, policy: Policy, body: GatewayRequest, choices: int, refused: tuple[str, int]
    ) -> Fit | None:
        """The request fitted into what its tenant has left now under the limit that `refused` it
        (None: it fits as it is), checked again at its fitted size, so a request limit refuses before
        the compression runs; a limit that binds the fitted request (the same one, when another
        request took room meanwhile, or the other of tokens and spend) fits it again where its
        policy says so. `refused`: the quota's refusal (reason, Retry-After), answered under the floor."""
        scopes = self._scopes(tenant, policy, body.model)
        prompt = prompt_token_bound(body, policy)
        output = output_token_bound(body, policy, choices)
        reason, retry_after_s = refused
        limit = fit_limit_of(reason) or "quota"
        fit: Fit | None = None
        try:
            # Again when the check finds less room than was read (another request took it meanwhile)
            # or a second limit binding the fitted request (tokens and spend).
            for _ in range(_FIT_READS):
                room, prices = await self._room(limit, tenant, scopes, policy)
                size = (fit.budget, fit.output_tokens * choices) if fit else (prompt, output)
                fitted = fit_into(policy.fit, limit, room, *size, choices, prices)
                if fitted is None and fit is None:
                    return None
                if fitted is not None:
                    fit = dataclasses.replace(
                        fitted, reason=reason, retry_after_s=retry_after_s, would_have_needed=prompt + output
                    )
                assert fit is not None
                try:
                    await self._check(tenant, scopes, policy, fit.budget, fit.output_tokens * choices)
                    return fit
                except QuotaExceeded as exc:
                    other = fit_limit_of(exc.reason)
                    if other is None or policy.fit.action(other) != "compress":
                        raise
                    limit, reason, retry_after_s = other, exc.reason, exc.retry_after_s
            raise QuotaExceeded(
                reason, retry_after_s, f"the request does not fit the tenant's {reason} quota"
            )
        except FitRefused as exc:
            self.metrics.fit_requests.labels(policy.name, limit, "refused").inc()
            self.metrics.quota_rejections.labels(tenant.name, reason).inc()
            raise APIError(
                429,
                str(exc),
                code=reason,
                error_type="rate_limit_error",
                headers={"Retry-After": str(retry_after_s)},
            ) from None
        except QuotaExceeded as exc:
            self.metrics.fit_requests.labels(policy.name, limit, "refused").inc()
            raise self._quota_refusal(tenant, exc) from None
        except StoreUnavailable:  # left to `reserve`, which applies on_store_error
            return None

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
        self.budget.controller.forget(prepared.request_id)
        await self.reconcile(prepared.reservation, 0, 0.0)

    async def settle(self, prepared: Prepared, totals: DeltaTotals, count_metrics: bool = True) -> Usage:
        """Reconcile the quota, record metrics, and return `usage` (with `usage.ctxgate`)."""
        policy, tenant, result = prepared.policy, prepared.tenant, prepared.result
        prompt_tokens = totals.prompt_tokens or result.prompt_tokens
        charged = cost(policy, prompt_tokens, totals.completion_tokens)
        segments = usage_segments(result, prompt_tokens, totals.completion_tokens)
        if priced(policy):
            charged["segments"] = segment_costs(policy, segments)
        await self.reconcile(prepared.reservation, prompt_tokens + totals.completion_tokens, charged["total"])
        if count_metrics:
            labels = (tenant.name, policy.name)
            self.metrics.prompt_tokens_original.labels(*labels).inc(result.original_prompt_tokens)
            self.metrics.prompt_tokens_sent.labels(*labels).inc(result.prompt_tokens)
            self.metrics.completion_tokens.labels(*labels).inc(totals.completion_tokens)
            count_segments(self.metrics, tenant.name, policy.name, segments)
            for stage, saved in result.saved_tokens.items():
                self.metrics.saved_tokens.labels(stage, policy.name).inc(max(0, saved))
            if charged["total"] > 0:
                self.metrics.spend.labels(tenant.name, charged["currency"]).inc(charged["total"])
        metrics = totals.metrics or RequestMetrics()
        if metrics.prefill_ms > 0:
            self.observe_prefill(prompt_tokens, metrics.prefill_ms)
        first_token_ms = (
            (prepared.first_token_at - prepared.received_at) * 1000
            if prepared.first_token_at is not None
            else None
        )
        note_usage(policy.name, result.original_prompt_tokens, prompt_tokens, first_token_ms)
        budget = self.budget.outcome(prepared, totals.metrics)
        return Usage.of(
            prompt_tokens,
            totals.completion_tokens,
            metrics.cached_prompt_tokens,
            ctxgate={
                "tenant": tenant.name,
                "policy": policy.name,
                **compression_figures(result),
                "queue_ms": round(metrics.queue_ms, 3),
                "prefill_ms": round(metrics.prefill_ms, 3),
                "ttft_ms": round(metrics.ttft_ms, 3),
                "cached_prompt_tokens": metrics.cached_prompt_tokens,
                # null, not 0: a policy without prices has not made the request free.
                "cost": charged["total"] if priced(policy) else None,
                "cost_detail": charged if priced(policy) else None,
                "dropped_params": list(prepared.dropped_params),
                "segments": segments,
            }
            | _quota_usage(prepared.reservation)
            | ({"budget": budget} if budget is not None else {})
            | ({"fit": prepared.fit.report()} if prepared.fit is not None else {}),
        )


def _quota_usage(reservation: Reservation | None) -> dict[str, Any]:
    """`usage.ctxgate.quota`: every limit the request met, as its reservation left it (used, what
    remains, when it resets), or nothing for a request no limit counted."""
    if reservation is None or not reservation.usage:
        return {}
    return {"quota": [usage.report() for usage in reservation.usage]}
