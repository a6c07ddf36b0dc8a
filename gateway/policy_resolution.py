"""The policy one request runs under: the tenant's home policy or one it may name, with the overrides
it sent, at the tenant's prices, its input budget fitted to the model's context.

A requested policy or override can tighten what a tenant gets, never loosen it: its quota only caps
the tenant's (`quota_cap`) and its prices only raise the tenant's (`tenant_prices`).
"""

from __future__ import annotations

import logging

from ctxgate.backend.openai_api.errors import APIError
from ctxgate.gateway.access import Access
from ctxgate.gateway.keys import Tenant
from ctxgate.gateway.quota import QuotaLimits
from ctxgate.gateway.schemas import CtxgateExtras
from ctxgate.policies.loader import PolicyRegistry, apply_overrides
from ctxgate.policies.schema import CostPolicy, Policy

logger = logging.getLogger(__name__)


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
    return home.model_copy(
        update={
            "prompt_per_1k": max(home.prompt_per_1k, requested.prompt_per_1k),
            "completion_per_1k": max(home.completion_per_1k, requested.completion_per_1k),
        }
    )


class PolicyResolver:
    def __init__(self, policies: PolicyRegistry, access: Access):
        self.policies = policies
        self.access = access

    def resolve(self, tenant: Tenant, extras: CtxgateExtras | None, model: str | None = None) -> Policy:
        requested = extras.policy if extras else None
        name = requested or self.access.home_policy_name(tenant)
        if requested:
            self.access.check_policy_allowed(tenant, requested)
        policy = self.policies.get(name)
        if policy is None:
            allowed = self.access.allowed_policies(tenant)
            available = [n for n in self.policies.names() if allowed is None or n in allowed]
            raise APIError(
                400 if requested else 503,
                f"unknown policy '{name}' (available: {', '.join(available) or 'none'})",
                param="ctxgate.policy" if requested else None,
                code="policy_not_found",
            )
        home = self.home_policy(tenant)
        if extras and extras.overrides:
            try:
                policy = apply_overrides(policy, extras.overrides)
            except ValueError as exc:
                raise APIError(
                    400, str(exc), param="ctxgate.overrides", code="override_not_allowed"
                ) from None
        if home is not None:
            policy = policy.model_copy(update={"cost": tenant_prices(home.cost, policy.cost)})
        return self.fit_to_model(policy, model)

    def home_policy(self, tenant: Tenant) -> Policy | None:
        """A bounded tenant's home policy (its quota and prices); None in open mode, where the
        requested policy's own apply. A bounded tenant whose home policy is not loaded is refused:
        there would be nothing to hold it to."""
        if not tenant.bounded:
            return None
        home = self.policies.get(self.access.home_policy_name(tenant))
        if home is None:
            logger.error(
                "policy '%s' of tenant %s is not loaded", self.access.home_policy_name(tenant), tenant.name
            )
            raise APIError(
                503,
                "this key's policy is not available; try again later",
                code="policy_not_found",
                headers={"Retry-After": "1"},
            )
        return home

    def fit_to_model(self, policy: Policy, model: str | None = None) -> Policy:
        """Cap the input budget at what the model can hold with at least one output token."""
        limit = self.access.engine_for(model).max_model_len - 1
        if policy.max_input_tokens <= limit:
            return policy
        return policy.model_copy(update={"max_input_tokens": limit})
