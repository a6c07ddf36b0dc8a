"""The fit stage (compression/stages/fit.py): the rendered prompt never exceeds the budget."""

from __future__ import annotations

import pytest

from ctxgate.compression.stages.cost_check import CostCheckStage
from ctxgate.compression.stages.fit import FitStage
from ctxgate.compression.types import BudgetExceededError
from ctxgate.policies.schema import Policy
from tests.compression.stages.support import (
    DOCUMENTS,
    QUESTION,
    SYSTEM,
    assert_no_broken_exchange,
    history_turns,
    setup_state,
    tool_exchange,
)


async def test_fit_trims_the_lowest_scored_sentences_until_the_prompt_fits(tokenizer):
    policy = Policy(name="p", max_input_tokens=200, documents={"max_tokens": 200})
    state, ctx = setup_state(tokenizer, policy, documents=DOCUMENTS)
    await CostCheckStage().run(state, ctx)
    for rank, passage in enumerate(state.passages):
        passage.sentences = ctx.services.splitter.split(passage.text)
        passage.sentence_scores = [1.0 - rank / 10, 0.5 - rank / 10]
    report = await FitStage().run(state, ctx)
    assert state.sent.tokens == tokenizer.count_chat(state.sent.messages) <= 200
    assert report.details["trimmed_units"] == state.trimmed_units > 0
    assert state.sent.messages[0] == SYSTEM and QUESTION["content"] in state.sent.messages[-1]["content"]
    kept_first = state.passages[0].body()
    assert "Passage 0 says" in kept_first  # the best sentence outlives the lower-scored ones


async def test_fit_sends_the_original_when_compression_is_skipped(tokenizer):
    policy = Policy(name="p", max_input_tokens=2000, compression_enabled=False)
    state, ctx = setup_state(tokenizer, policy, documents=DOCUMENTS)
    await CostCheckStage().run(state, ctx)
    await FitStage().run(state, ctx)
    assert state.sent == state.original


async def test_fit_refuses_an_original_over_budget_when_compression_is_skipped(tokenizer):
    policy = Policy(name="p", max_input_tokens=120, documents={"max_tokens": 120}, compression_enabled=False)
    state, ctx = setup_state(tokenizer, policy, documents=DOCUMENTS)
    await CostCheckStage().run(state, ctx)
    with pytest.raises(BudgetExceededError, match="disables compression"):
        await FitStage().run(state, ctx)


async def test_fit_drops_a_tool_exchange_whole_and_never_leaves_a_reply_alone(tokenizer):
    # History off: only the fit stage cuts, oldest unit first.
    policy = Policy(name="p", max_input_tokens=180, history={"enabled": False}, documents={"max_tokens": 50})
    history = tool_exchange(0) + history_turns(3)
    state, ctx = setup_state(tokenizer, policy, messages=[SYSTEM, *history, QUESTION])
    await CostCheckStage().run(state, ctx)
    await FitStage().run(state, ctx)
    assert state.sent.tokens == tokenizer.count_chat(state.sent.messages) <= 180
    assert state.history == history[len(history) - len(state.history) :]
    assert_no_broken_exchange(state.history)
    assert state.history[0]["role"] != "tool"
