"""The cost check: measures the original prompt and the parts never cut, and decides whether
compressing pays for itself.

Rule: when the pinned parts alone are over the budget the request is refused
(`BudgetExceededError`, a 413); when the estimated saving is under the policy's `min_saving_ms`
(and the original fits), or the policy disables compression, the compressing stages stand aside.
"""

from __future__ import annotations

from ctxgate.compression.rendering import order_passages, render_context, render_prompt, render_slots
from ctxgate.compression.stages.base import Stage, StageContext
from ctxgate.compression.stages.budget import forced_saving, pinned_tokens
from ctxgate.compression.state import PipelineState, RenderedPrompt
from ctxgate.compression.types import StageReport
from ctxgate.policies.schema import Policy


class CostCheckStage(Stage):
    """Measures the original prompt and the parts never cut, refuses (413) when those alone are over
    budget, and decides whether compressing pays for itself."""

    name = "cost-check"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        return True

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        state.original = render_original(state, ctx)
        state.pinned_tokens = pinned_tokens(state, ctx)
        state.skip_reason = self.skip_reason(state, ctx)
        if state.skip_reason is not None:
            return StageReport(self.name, details={"skipped": state.skip_reason})
        policy = ctx.policy
        state.history_budget = max(
            0, min(policy.history.max_tokens, state.budget_tokens - state.pinned_tokens)
        )
        return StageReport(self.name)

    def skip_reason(self, state: PipelineState, ctx: StageContext) -> str | None:
        policy = ctx.policy
        assert state.original is not None
        if not policy.compression_enabled:
            return "compression disabled by policy"
        if policy.min_saving_ms <= 0 or state.original.tokens > policy.max_input_tokens:
            return None
        net_ms = ctx.services.cost_estimator.net_saving_ms(forced_saving(state, ctx))
        if net_ms < policy.min_saving_ms:
            return f"estimated saving {net_ms:.1f} ms < min_saving_ms {policy.min_saving_ms}"
        return None


def render_original(state: PipelineState, ctx: StageContext) -> RenderedPrompt:
    """Every document inline (request order, titles kept) and the full history."""
    passages = order_passages(state.passages, "original")
    context_text = render_context(passages)
    slot_texts = render_slots(passages) if state.context_slots else None
    messages, layouts = render_prompt(
        state, context_text, list(state.history), None, ctx.policy.assembly, slot_texts
    )
    return RenderedPrompt(messages, ctx.counter.count_chat(messages), layouts)
