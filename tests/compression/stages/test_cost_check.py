"""The cost check (compression/stages/cost_check.py): measures, refuses, or skips compression."""

from __future__ import annotations

import pytest

from ctxgate.compression.stages.cost_check import CostCheckStage
from ctxgate.compression.types import BudgetExceededError
from ctxgate.policies.schema import Policy
from tests.compression.stages.support import DOCUMENTS, QUESTION, SYSTEM, setup_state


async def test_cost_check_measures_and_sets_the_history_budget(tokenizer):
    policy = Policy(
        name="p", max_input_tokens=600, documents={"max_tokens": 300}, history={"max_tokens": 5000}
    )
    state, ctx = setup_state(tokenizer, policy, documents=DOCUMENTS)
    report = await CostCheckStage().run(state, ctx)
    assert report.details == {} and state.compressing
    assert state.original.tokens == tokenizer.count_chat(state.original.messages)
    assert all(d.text in state.original.messages[-1]["content"] for d in DOCUMENTS)
    pinned_alone = tokenizer.count_chat([SYSTEM, QUESTION])
    assert pinned_alone < state.pinned_tokens < state.original.tokens  # plus the context block's framing
    assert state.history_budget == 600 - state.pinned_tokens  # capped by the budget, not history.max_tokens


async def test_cost_check_refuses_when_the_pinned_parts_alone_are_over_budget(tokenizer):
    policy = Policy(name="p", max_input_tokens=16, documents={"max_tokens": 16})
    state, ctx = setup_state(tokenizer, policy)
    with pytest.raises(BudgetExceededError) as info:
        await CostCheckStage().run(state, ctx)
    assert info.value.budget_tokens == 16 and info.value.required_tokens > 16


async def test_cost_check_skips_when_the_policy_disables_compression(tokenizer):
    policy = Policy(name="p", compression_enabled=False)
    state, ctx = setup_state(tokenizer, policy, documents=DOCUMENTS)
    report = await CostCheckStage().run(state, ctx)
    assert report.details["skipped"] == "compression disabled by policy" and not state.compressing
