"""The history stage: older turns over the history budget are summarized (or dropped); the last
ones stay verbatim.

Rule: the kept history fits `state.history_budget`, and a tool exchange (a call with its replies)
is kept verbatim or dropped whole, never summarized or split.
"""

from __future__ import annotations

from ctxgate.compression.history import is_tool_unit, turn_units
from ctxgate.compression.rendering import SUMMARY_HEADER
from ctxgate.compression.stages.base import Stage, StageContext
from ctxgate.compression.stages.budget import MESSAGE_FRAMING_TOKENS, history_tokens, turn_cost
from ctxgate.compression.state import PipelineState
from ctxgate.compression.types import StageReport
from ctxgate.policies.schema import Policy

MIN_SUMMARY_TOKENS = 8  # below this a summary says nothing: the older turns are dropped instead


class HistoryStage(Stage):
    """Older turns over the history budget are summarized (or dropped); the last ones stay verbatim.

    A tool exchange (an assistant turn with `tool_calls` and its `tool` replies) is one unit, kept
    verbatim or dropped whole, never summarized or split: a summary cannot stand in for the calls
    and results a model (or the client's agent loop) refers back to, and a call without its replies
    (or replies without their call) is a conversation an OpenAI-style server refuses. Older tool
    exchanges are kept before the summary gets any room; one that cannot fit is dropped whole and
    counted in the report (`tool_exchanges_dropped`)."""

    name = "history"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        # A conversation the conversation stage carried has its history fitted there.
        return state.compressing and policy.history.enabled and state.carried is None

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        before = history_tokens(ctx.counter, state)
        budget = state.history_budget
        report = StageReport(self.name, details={"turns": len(state.history), "budget": budget})
        if before <= budget:
            return report
        costs = [turn_cost(ctx.counter, m) for m in state.history]
        units = turn_units(state.history)
        unit_costs = [sum(costs[start:end]) for start, end in units]
        if ctx.policy.history.strategy == "truncate":
            keep_from = oldest_kept_turn(unit_costs, budget)
            kept = set(range(keep_from, len(units)))
            report.details["dropped_turns"] = (
                units[keep_from][0] if keep_from < len(units) else len(state.history)
            )
        else:
            kept = await self.summarize_older_turns(state, ctx, units, unit_costs, report)
        tool_units = [u for u, unit in enumerate(units) if is_tool_unit(state.history, unit)]
        if tool_units:
            report.details["tool_exchanges_kept"] = sum(u in kept for u in tool_units)
            report.details["tool_exchanges_dropped"] = sum(u not in kept for u in tool_units)
        state.history = [m for u in sorted(kept) for m in state.history[units[u][0] : units[u][1]]]
        report.saved_tokens = before - history_tokens(ctx.counter, state)
        return report

    async def summarize_older_turns(
        self,
        state: PipelineState,
        ctx: StageContext,
        units: list[tuple[int, int]],
        unit_costs: list[int],
        report: StageReport,
    ) -> set[int]:
        """Summarize the older plain turns into `state.summary`; return the units kept verbatim."""
        policy = ctx.policy.history
        budget = state.history_budget
        # The last `keep_last_turns` turns stay verbatim (widened to whole units)...
        tail_start = max(0, len(state.history) - policy.keep_last_turns)
        tail = next((u for u, (_, end) in enumerate(units) if end > tail_start), len(units))
        while tail < len(units) and sum(unit_costs[tail:]) > budget:
            tail += 1  # even the kept turns must fit the promise
        kept = set(range(tail, len(units)))
        spent = sum(unit_costs[tail:])
        # ...and so do the older tool exchanges, newest first, while they fit.
        for u in reversed(range(tail)):
            if is_tool_unit(state.history, units[u]) and spent + unit_costs[u] <= budget:
                kept.add(u)
                spent += unit_costs[u]
        older = [
            message
            for u in range(tail)
            if u not in kept and not is_tool_unit(state.history, units[u])
            for message in state.history[units[u][0] : units[u][1]]
        ]
        # The header, the turn's framing and the quote mark (+ the newline) around the summary.
        summary_overhead = ctx.counter.count(SUMMARY_HEADER + "\n> ") + MESSAGE_FRAMING_TOKENS + 1
        summary_budget = min(policy.summary_max_tokens, budget - spent - summary_overhead)
        summary = None
        if older and summary_budget >= MIN_SUMMARY_TOKENS:
            outcome = await ctx.services.summarizer.summarize(
                state.tenant,
                older,
                state.question_text,
                summary_budget,
                policy.summary_timeout_s,
                use_engine=policy.strategy == "summarize",
            )
            summary = outcome.text or None
            report.details.update(
                summary_source=outcome.source, engine_calls=outcome.engine_calls, summarized_turns=len(older)
            )
        state.summary = summary
        return kept


def oldest_kept_turn(costs: list[int], budget: int) -> int:
    """Index of the oldest turn kept when the newest turns that fit `budget` are kept."""
    keep_from = len(costs)
    spent = 0
    while keep_from > 0 and spent + costs[keep_from - 1] <= budget:
        keep_from -= 1
        spent += costs[keep_from]
    return keep_from
