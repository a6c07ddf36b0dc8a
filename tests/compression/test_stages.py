"""Unit tests of compression/stages.py: the order of the stages and each stage's contract."""

from __future__ import annotations

import pytest

from compression.pipeline import CompressionPipeline
from compression.rendering import render_context
from compression.stages import (
    STAGES,
    AssemblyStage,
    CostCheckStage,
    ExtractionStage,
    FitStage,
    HistoryStage,
    StageContext,
    history_tokens,
    oldest_kept_turn,
)
from compression.state import PipelineState, split_messages
from compression.types import BudgetExceededError, CompressionInput, Document, RetrievalSpec
from policies.schema import Policy

SYSTEM = {"role": "system", "content": "Answer from the documents."}
QUESTION = {"role": "user", "content": "Which river runs through Lyon?"}
DOCUMENTS = [
    Document(text=f"Passage {i} says the Rhone and the Saone meet in Lyon. It is a long river.", title=f"T{i}")
    for i in range(6)
]


def _history(turns: int) -> list[dict[str, str]]:
    messages = []
    for turn in range(turns):
        messages += [
            {"role": "user", "content": f"Question number {turn} about French rivers and their towns?"},
            {"role": "assistant", "content": f"Answer {turn}: " + "rivers shape the towns along them. " * 4},
        ]
    return messages


def _setup(tokenizer, policy: Policy, messages=None, documents=()) -> tuple[PipelineState, StageContext]:
    pipeline = CompressionPipeline(tokenizer)
    request = CompressionInput(messages=messages or [SYSTEM, QUESTION], documents=list(documents))
    state = split_messages(request, budget_tokens=policy.max_input_tokens)
    return state, StageContext(policy=policy, counter=pipeline.counter, services=pipeline.services)


def test_stage_order_is_the_algorithm():
    assert [stage.name for stage in STAGES] == [
        "retrieval", "message-context", "cost-check", "history", "dedup", "rerank", "extraction", "assembly", "fit"
    ]


def test_enabled_follows_the_request_the_policy_and_the_cost_check(tokenizer):
    policy = Policy(name="p", history={"enabled": False}, dedup={"enabled": True}, rerank={"enabled": False})
    state, _ = _setup(tokenizer, policy)
    enabled = [stage.name for stage in STAGES if stage.enabled(state, policy)]
    assert enabled == ["cost-check", "dedup", "extraction", "assembly", "fit"]
    state.retrieval = RetrievalSpec(index="wiki")
    assert STAGES[0].enabled(state, policy)
    # Once the cost check skips compression only the measuring and the fit remain.
    state.skip_reason = "compression disabled by policy"
    assert [stage.name for stage in STAGES if stage.enabled(state, policy)] == ["retrieval", "cost-check", "fit"]


async def test_cost_check_measures_and_sets_the_history_budget(tokenizer):
    policy = Policy(name="p", max_input_tokens=600, documents={"max_tokens": 300}, history={"max_tokens": 5000})
    state, ctx = _setup(tokenizer, policy, documents=DOCUMENTS)
    report = await CostCheckStage().run(state, ctx)
    assert report.details == {} and state.compressing
    assert state.original.tokens == tokenizer.count_chat(state.original.messages)
    assert all(d.text in state.original.messages[-1]["content"] for d in DOCUMENTS)
    pinned_alone = tokenizer.count_chat([SYSTEM, QUESTION])
    assert pinned_alone < state.pinned_tokens < state.original.tokens  # plus the context block's framing
    assert state.history_budget == 600 - state.pinned_tokens  # capped by the budget, not history.max_tokens


async def test_cost_check_refuses_when_the_pinned_parts_alone_are_over_budget(tokenizer):
    policy = Policy(name="p", max_input_tokens=16, documents={"max_tokens": 16})
    state, ctx = _setup(tokenizer, policy)
    with pytest.raises(BudgetExceededError) as info:
        await CostCheckStage().run(state, ctx)
    assert info.value.budget_tokens == 16 and info.value.required_tokens > 16


async def test_cost_check_skips_when_the_policy_disables_compression(tokenizer):
    policy = Policy(name="p", compression_enabled=False)
    state, ctx = _setup(tokenizer, policy, documents=DOCUMENTS)
    report = await CostCheckStage().run(state, ctx)
    assert report.details["skipped"] == "compression disabled by policy" and not state.compressing


def test_oldest_kept_turn_keeps_the_newest_turns_that_fit():
    assert oldest_kept_turn([5, 5, 5, 5], budget=10) == 2
    assert oldest_kept_turn([5, 5, 5, 5], budget=100) == 0
    assert oldest_kept_turn([5, 20, 5], budget=12) == 2  # a turn too big stops the walk back
    assert oldest_kept_turn([5], budget=4) == 1


async def test_history_truncate_keeps_the_newest_turns_within_budget(tokenizer):
    policy = Policy(name="p", history={"strategy": "truncate"})
    history = _history(6)
    state, ctx = _setup(tokenizer, policy, messages=[SYSTEM, *history, QUESTION])
    state.history_budget = 150
    before = history_tokens(ctx.counter, state)
    report = await HistoryStage().run(state, ctx)
    assert state.history == history[report.details["dropped_turns"]:]
    assert 0 < history_tokens(ctx.counter, state) <= 150
    assert report.saved_tokens == before - history_tokens(ctx.counter, state)


async def test_extraction_by_passage_fits_the_documents_budget(tokenizer):
    policy = Policy(name="p", max_input_tokens=2000, documents={"max_tokens": 70}, extraction={"unit": "passage"})
    state, ctx = _setup(tokenizer, policy, documents=DOCUMENTS)
    for rank, passage in enumerate(state.passages):
        passage.score = 1.0 - rank / 10
    report = await ExtractionStage().run(state, ctx)
    assert report.details["budget"] == 70
    assert 0 < tokenizer.count(render_context(state.passages)) <= 70
    assert [p.title for p in state.passages] == ["T0", "T1"][: len(state.passages)]  # best scores kept
    assert report.saved_tokens > 0


async def test_assembly_orders_passages_as_the_policy_says(tokenizer):
    policy = Policy(name="p", assembly={"order": "best-at-ends"})
    state, ctx = _setup(tokenizer, policy, documents=DOCUMENTS[:5])
    for passage, score in zip(state.passages, [0.1, 0.9, 0.5, 0.7, 0.3], strict=True):
        passage.score = score
    report = await AssemblyStage().run(state, ctx)
    assert [p.score for p in state.passages] == [0.9, 0.5, 0.1, 0.3, 0.7]
    assert report.details == {"order": "best-at-ends"} and report.saved_tokens == 0


async def test_fit_trims_the_lowest_scored_sentences_until_the_prompt_fits(tokenizer):
    policy = Policy(name="p", max_input_tokens=200, documents={"max_tokens": 200})
    state, ctx = _setup(tokenizer, policy, documents=DOCUMENTS)
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
    state, ctx = _setup(tokenizer, policy, documents=DOCUMENTS)
    await CostCheckStage().run(state, ctx)
    await FitStage().run(state, ctx)
    assert state.sent == state.original


async def test_fit_refuses_an_original_over_budget_when_compression_is_skipped(tokenizer):
    policy = Policy(name="p", max_input_tokens=120, documents={"max_tokens": 120}, compression_enabled=False)
    state, ctx = _setup(tokenizer, policy, documents=DOCUMENTS)
    await CostCheckStage().run(state, ctx)
    with pytest.raises(BudgetExceededError, match="disables compression"):
        await FitStage().run(state, ctx)


# -- tool exchanges in the history ------------------------------------------------------------------
def _tool_exchange(turn: int) -> list[dict]:
    call_id = f"call_{turn}"
    return [
        # Content "" as the gateway passes it (m.text() of a null content).
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "river_length", "arguments": f'{{"river": "Rhone", "turn": {turn}}}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": f"The Rhone is 813 km long (lookup {turn})."},
    ]


def _assert_no_broken_exchange(history: list[dict]) -> None:
    """Every tool reply follows its call, every call keeps all its replies."""
    open_calls: set[str] = set()
    for message in history:
        if message["role"] == "tool":
            assert message["tool_call_id"] in open_calls, history
            open_calls.discard(message["tool_call_id"])
        else:
            assert not open_calls, history  # a call lost its reply
            open_calls = {call["id"] for call in message.get("tool_calls") or []}
    assert not open_calls


def test_turn_units_keep_a_tool_call_with_its_replies():
    from compression.history import is_tool_unit, turn_units

    history = [_history(1)[0], *_tool_exchange(0), _history(1)[1]]
    history.insert(3, {"role": "tool", "tool_call_id": "call_0", "content": "A second reply."})
    units = turn_units(history)
    assert units == [(0, 1), (1, 4), (4, 5)]
    assert [is_tool_unit(history, unit) for unit in units] == [False, True, False]


@pytest.mark.parametrize("strategy", ["extractive", "truncate"])
async def test_history_keeps_tool_exchanges_whole_and_verbatim(tokenizer, strategy):
    policy = Policy(name="p", history={"strategy": strategy, "keep_last_turns": 2, "summary_max_tokens": 40})
    exchange = _tool_exchange(0)
    # The tool exchange is old (outside the last turns), the plain turns around it are long.
    history = _history(3) + exchange + _history(3)
    state, ctx = _setup(tokenizer, policy, messages=[SYSTEM, *history, QUESTION])
    state.history_budget = 260
    report = await HistoryStage().run(state, ctx)
    _assert_no_broken_exchange(state.history)
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
    history = _history(4) + _tool_exchange(0)
    state, ctx = _setup(tokenizer, policy, messages=[SYSTEM, *history, QUESTION])
    state.history_budget = 150
    await HistoryStage().run(state, ctx)
    assert state.history[-2:] == history[-2:]
    _assert_no_broken_exchange(state.history)


async def test_history_drops_a_tool_exchange_that_cannot_fit_whole(tokenizer):
    policy = Policy(name="p", history={"strategy": "extractive", "keep_last_turns": 2})
    history = _history(2) + _tool_exchange(0) + _history(1)
    state, ctx = _setup(tokenizer, policy, messages=[SYSTEM, *history, QUESTION])
    state.history_budget = 70  # the last two turns fit, the exchange beside them does not
    report = await HistoryStage().run(state, ctx)
    assert report.details["tool_exchanges_dropped"] == 1
    assert not any(m["role"] == "tool" or m.get("tool_calls") for m in state.history)
    assert history_tokens(ctx.counter, state) <= 70


async def test_fit_drops_a_tool_exchange_whole_and_never_leaves_a_reply_alone(tokenizer):
    # History off: only the fit stage cuts, oldest unit first.
    policy = Policy(name="p", max_input_tokens=180, history={"enabled": False}, documents={"max_tokens": 50})
    history = _tool_exchange(0) + _history(3)
    state, ctx = _setup(tokenizer, policy, messages=[SYSTEM, *history, QUESTION])
    await CostCheckStage().run(state, ctx)
    await FitStage().run(state, ctx)
    assert state.sent.tokens == tokenizer.count_chat(state.sent.messages) <= 180
    assert state.history == history[len(history) - len(state.history):]
    _assert_no_broken_exchange(state.history)
    assert state.history[0]["role"] != "tool"


def test_split_passages_are_priced_by_sentence_and_a_changed_body_is_not_tokenized_again(tokenizer):
    from compression.counting import CachedCounter
    from compression.stages import ensure_sentences, passages_tokens

    class Recording:
        def __init__(self):
            self.texts: list[str] = []

        def count(self, text: str) -> int:
            self.texts.append(text)
            return tokenizer.count(text)

    state, ctx = _setup(tokenizer, Policy(name="p"), documents=DOCUMENTS[:2])
    ensure_sentences(ctx, state.passages)
    first = state.passages[0]
    assert first.body_sentences() == first.sentences and len(first.sentences) == 2
    recording = Recording()
    counter = CachedCounter(recording)
    priced = passages_tokens(counter, state.passages)
    assert set(recording.texts) == {s for p in state.passages for s in p.sentences}
    assert abs(priced - sum(tokenizer.count(p.text) for p in state.passages)) <= 2 * len(state.passages)

    first.removed_sentences.add(0)
    recording.texts.clear()
    after = passages_tokens(counter, state.passages)
    assert first.body_sentences() == first.sentences[1:] and first.body() == first.sentences[1]
    assert after == priced - tokenizer.count(first.sentences[0]) and recording.texts == []
