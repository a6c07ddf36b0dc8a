"""The history stage (compression/stages/history.py): the newest turns kept, tool exchanges whole."""

from __future__ import annotations

import pytest

from ctxgate.compression.stages.budget import history_tokens
from ctxgate.compression.stages.history import HistoryStage, oldest_kept_turn
from ctxgate.policies.schema import Policy
from tests.compression.stages.support import (
    QUESTION,
    SYSTEM,
    assert_no_broken_exchange,
    history_turns,
    setup_state,
    tool_exchange,
)


def test_oldest_kept_turn_keeps_the_newest_turns_that_fit():
    assert oldest_kept_turn([5, 5, 5, 5], budget=10) == 2
    assert oldest_kept_turn([5, 5, 5, 5], budget=100) == 0
    assert oldest_kept_turn([5, 20, 5], budget=12) == 2  # a turn too big stops the walk back
    assert oldest_kept_turn([5], budget=4) == 1


async def test_history_truncate_keeps_the_newest_turns_within_budget(tokenizer):
    policy = Policy(name="p", history={"strategy": "truncate"})
    history = history_turns(6)
    state, ctx = setup_state(tokenizer, policy, messages=[SYSTEM, *history, QUESTION])
    state.history_budget = 150
    before = history_tokens(ctx.counter, state)
    report = await HistoryStage().run(state, ctx)
    assert state.history == history[report.details["dropped_turns"] :]
    assert 0 < history_tokens(ctx.counter, state) <= 150
    assert report.saved_tokens == before - history_tokens(ctx.counter, state)


def test_turn_units_keep_a_tool_call_with_its_replies():
    from ctxgate.compression.history import is_tool_unit, turn_units

    history = [history_turns(1)[0], *tool_exchange(0), history_turns(1)[1]]
    history.insert(3, {"role": "tool", "tool_call_id": "call_0", "content": "A second reply."})
    units = turn_units(history)
    assert units == [(0, 1), (1, 4), (4, 5)]
    assert [is_tool_unit(history, unit) for unit in units] == [False, True, False]


@pytest.mark.parametrize("strategy", ["extractive", "truncate"])
async def test_history_keeps_tool_exchanges_whole_and_verbatim(tokenizer, strategy):
    policy = Policy(name="p", history={"strategy": strategy, "keep_last_turns": 2, "summary_max_tokens": 40})
    exchange = tool_exchange(0)
    # The tool exchange is old (outside the last turns), the plain turns around it are long.
    history = history_turns(3) + exchange + history_turns(3)
    state, ctx = setup_state(tokenizer, policy, messages=[SYSTEM, *history, QUESTION])
    state.history_budget = 260
    report = await HistoryStage().run(state, ctx)
    assert_no_broken_exchange(state.history)
    assert history_tokens(ctx.counter, state) <= 260
    if strategy == "extractive":
        # Summarized around, never into the summary: the exchange is sent as it was.
        assert report.details["tool_exchanges_kept"] == 1
        assert all(message in state.history for message in exchange)
        assert "813 km" not in (state.summary or "") and state.summary
        assert state.history[-2:] == history[-2:]
    else:
        assert report.details["tool_exchanges_kept"] + report.details["tool_exchanges_dropped"] == 1


async def test_history_never_splits_a_tool_exchange_at_the_verbatim_edge(tokenizer):
    # keep_last_turns=1 would keep only the tool reply: the call before it is kept with it.
    policy = Policy(name="p", history={"strategy": "extractive", "keep_last_turns": 1})
    history = history_turns(4) + tool_exchange(0)
    state, ctx = setup_state(tokenizer, policy, messages=[SYSTEM, *history, QUESTION])
    state.history_budget = 150
    await HistoryStage().run(state, ctx)
    assert state.history[-2:] == history[-2:]
    assert_no_broken_exchange(state.history)


async def test_history_drops_a_tool_exchange_that_cannot_fit_whole(tokenizer):
    policy = Policy(name="p", history={"strategy": "extractive", "keep_last_turns": 2})
    history = history_turns(2) + tool_exchange(0) + history_turns(1)
    state, ctx = setup_state(tokenizer, policy, messages=[SYSTEM, *history, QUESTION])
    state.history_budget = 70  # the last two turns fit, the exchange beside them does not
    report = await HistoryStage().run(state, ctx)
    assert report.details["tool_exchanges_dropped"] == 1
    assert not any(m["role"] == "tool" or m.get("tool_calls") for m in state.history)
    assert history_tokens(ctx.counter, state) <= 70
