"""Adaptive policies: the documents budget chosen for the engine's load when a request arrives, and
what the controller (`ctxgate.gateway.budget_control`) learns from the request's measured TTFT."""

from __future__ import annotations

from typing import Any

from ctxgate.backend.engine.api import RequestMetrics
from ctxgate.gateway.budget_control import BudgetController, Decision, Outcome
from ctxgate.gateway.metrics import GatewayMetrics
from ctxgate.gateway.prepared import Prepared
from ctxgate.policies.schema import Policy


class AdaptiveBudget:
    def __init__(self, controller: BudgetController, metrics: GatewayMetrics):
        self.controller = controller
        self.metrics = metrics

    def adapt(self, policy: Policy, request_id: str) -> tuple[Policy, Decision | None]:
        """An adaptive policy with its documents budget chosen for the engine's load now."""
        if not policy.adaptive.enabled or not policy.compression_enabled:
            return policy, None
        decision = self.controller.decide(
            request_id, policy.name, policy.adaptive, policy.documents.max_tokens
        )
        self.metrics.adaptive_budget_tokens.labels(policy.name).observe(decision.budget)
        self.metrics.adaptive_decisions.labels(policy.name, decision.reason).inc()
        documents = policy.documents.model_copy(
            update={"max_tokens": min(decision.budget, policy.max_input_tokens)}
        )
        return policy.model_copy(update={"documents": documents}), decision

    def outcome(self, prepared: Prepared, metrics: RequestMetrics | None) -> dict[str, Any] | None:
        """`usage.ctxgate.budget`, and what the controller learns from the request."""
        decision = prepared.budget
        if decision is None:
            return None
        if metrics is None or metrics.ttft_ms <= 0:  # no first token: nothing measured
            self.controller.forget(prepared.request_id)
            return decision.to_dict()
        result, slo = prepared.result, prepared.policy.adaptive.ttft_slo_s
        compression_s = (sum(result.compression_ms.values()) + result.wait_ms) / 1000
        # The gateway's TTFT, from the request's arrival: reading, compressing, tokenizing and the
        # engine's queue and prefill (the sum of the parts when no first token was timed here).
        if prepared.first_token_at is not None:
            ttft_s = prepared.first_token_at - prepared.received_at
        else:
            ttft_s = compression_s + metrics.ttft_ms / 1000
        self.controller.observe(
            prepared.request_id,
            decision.budget,
            Outcome(ttft_s, compression_s, result.prompt_tokens, metrics.prefill_ms),
        )
        met = ttft_s <= slo
        self.metrics.adaptive_slo_requests.labels(prepared.policy.name, str(met).lower()).inc()
        return decision.to_dict() | {"ttft_slo_s": slo, "measured_ttft_s": round(ttft_s, 4), "slo_met": met}
