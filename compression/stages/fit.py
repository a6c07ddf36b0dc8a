"""The fit stage: renders the prompt and counts it exactly.

Rule: the rendered prompt never exceeds the budget (`policy.max_input_tokens`): the least valuable
units are dropped until it fits, and a prompt that cannot fit is refused (`BudgetExceededError`).
When the cost check skipped compression the original is sent as it is, if it fits.
"""

from __future__ import annotations

from ctxgate.compression.extraction import drop_lowest_sentence
from ctxgate.compression.rendering import order_passages, render_context, render_prompt, render_slots
from ctxgate.compression.stages.base import Stage, StageContext
from ctxgate.compression.stages.budget import drop_least_valuable_unit
from ctxgate.compression.state import PipelineState, RenderedPrompt
from ctxgate.compression.types import BudgetExceededError, StageReport
from ctxgate.policies.schema import Policy


class FitStage(Stage):
    """Renders the prompt and counts it exactly; drops the least valuable units until it fits.

    When the cost check skipped compression, the original prompt is sent if it fits the budget and
    refused (`BudgetExceededError`) otherwise.
    """

    name = "fit"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        return True

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        if not state.compressing:
            send_original(state)
            return StageReport(self.name)
        state.trimmed_units = cap_passages_block(state, ctx)
        while True:
            state.sent = render_sent(state, ctx)
            if state.sent.tokens <= state.budget_tokens:
                return StageReport(self.name, details={"trimmed_units": state.trimmed_units})
            # Drop units worth at least the excess (estimated), then count exactly again.
            excess = state.sent.tokens - state.budget_tokens
            while excess > 0:
                removed = drop_least_valuable_unit(state, ctx.counter)
                if removed is None:
                    raise BudgetExceededError(
                        f"prompt of {state.sent.tokens} tokens cannot fit the budget of {state.budget_tokens}",
                        required_tokens=state.sent.tokens,
                        budget_tokens=state.budget_tokens,
                    )
                state.trimmed_units += 1
                excess -= max(1, removed)


def send_original(state: PipelineState) -> None:
    assert state.original is not None
    if state.original.tokens > state.budget_tokens:
        raise BudgetExceededError(
            f"the prompt takes {state.original.tokens} tokens, over the budget of {state.budget_tokens}, "
            "and this policy disables compression",
            required_tokens=state.original.tokens,
            budget_tokens=state.budget_tokens,
        )
    state.passages = order_passages(state.passages, "original")
    state.sent = state.original


def cap_passages_block(state: PipelineState, ctx: StageContext) -> int:
    """The passages block keeps its own cap exactly (numbering and order can shift a token)."""
    keep_titles = ctx.policy.extraction.keep_titles
    dropped = 0
    while (
        state.passages
        and ctx.counter.count(render_context(state.passages, keep_titles)) > ctx.policy.documents.max_tokens
    ):
        if drop_lowest_sentence(state.passages) is None:
            break
        dropped += 1
    return dropped


def render_sent(state: PipelineState, ctx: StageContext) -> RenderedPrompt:
    passages = [p for p in state.passages if not p.is_empty()]
    keep_titles = ctx.policy.extraction.keep_titles
    context_text = render_context(passages, keep_titles)
    slot_texts = render_slots(passages, keep_titles) if state.context_slots else None
    messages, layouts = render_prompt(
        state, context_text, state.history, state.summary, ctx.policy.assembly, slot_texts
    )
    return RenderedPrompt(messages, ctx.counter.count_chat(messages), layouts)
