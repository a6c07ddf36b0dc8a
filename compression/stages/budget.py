"""Token accounting: what the history, the passages and the pinned parts cost, what the budgets
leave the documents, and the fit's cuts, one unit at a time.

Rule: stage estimates come from cached per-unit counts (each text tokenized once); only the
pinned parts and the rendered prompts are counted exactly. The pinned parts (system messages,
question, the context block's framing) are never cut: over the budget alone, they are refused.
"""

from __future__ import annotations

import json
from typing import Any

from ctxgate.compression.counting import CachedCounter, least_tokens
from ctxgate.compression.extraction import drop_lowest_sentence
from ctxgate.compression.history import turn_units
from ctxgate.compression.rendering import render_messages, summary_text
from ctxgate.compression.stages.base import StageContext
from ctxgate.compression.state import Passage, PipelineState, message_text
from ctxgate.compression.types import BudgetExceededError

MESSAGE_FRAMING_TOKENS = 5  # role + start/end markers around one chat message (estimate)


def turn_cost(counter: CachedCounter, message: dict[str, Any]) -> int:
    cost = counter.count(message_text(message)) + MESSAGE_FRAMING_TOKENS
    calls = message.get("tool_calls") or message.get("function_call")
    if calls:  # the call's name and arguments are sent too
        cost += counter.count(json.dumps(calls, ensure_ascii=False))
    return cost


def history_tokens(counter: CachedCounter, state: PipelineState) -> int:
    total = sum(turn_cost(counter, m) for m in state.history)
    if state.summary:
        total += counter.count(summary_text(state.summary)) + MESSAGE_FRAMING_TOKENS
    return total


def passages_tokens(counter: CachedCounter, passages: list[Passage]) -> int:
    """The passages' bodies in tokens, as the stages price them: a split passage is the sum of its
    sentences (each text counted once and cached), so a body that dedup or extraction changed is
    not tokenized again. Within a token or two of counting the joined body; the stages' savings are
    estimates anyway, and the fit's exact count of the prompt reconciles them."""
    texts: list[str] = []
    for passage in passages:
        texts.extend([passage.body()] if passage.sentences is None else passage.body_sentences())
    return sum(counter.count_many([text for text in texts if text.strip()]))


def documents_budget(state: PipelineState, ctx: StageContext) -> int:
    remaining = state.budget_tokens - state.pinned_tokens - history_tokens(ctx.counter, state)
    return max(0, min(ctx.policy.documents.max_tokens, remaining))


def pinned_tokens(state: PipelineState, ctx: StageContext) -> int:
    """Tokens of what is never cut; `BudgetExceededError` when that alone is over the budget."""
    assembly = ctx.policy.assembly
    messages = render_messages(state, "", [], None, assembly)
    # Bounded from the text's length first: a megabyte of question is refused without counting it.
    texts = "".join(message_text(message) for message in messages)  # the prompt holds each verbatim
    least = least_tokens(texts, ctx.counter.max_token_bytes)
    if least > state.budget_tokens:
        raise BudgetExceededError(
            f"the system prompt and question alone take at least {least} tokens, "
            f"over the budget of {state.budget_tokens} (max_input_tokens)",
            required_tokens=least,
            budget_tokens=state.budget_tokens,
        )
    pinned = ctx.counter.count_chat(messages)
    if pinned > state.budget_tokens:
        raise BudgetExceededError(
            f"the system prompt and question alone take {pinned} tokens, "
            f"over the budget of {state.budget_tokens} (max_input_tokens)",
            required_tokens=pinned,
            budget_tokens=state.budget_tokens,
        )
    if state.passages:
        # With passages the context block's own framing is pinned too: measured around a 1-token block.
        pinned = ctx.counter.count_chat(render_messages(state, "x", [], None, assembly)) - 1
    return pinned


def forced_saving(state: PipelineState, ctx: StageContext) -> int:
    """Upper bound of what the budgets force out; if even that does not pay, do nothing."""
    policy = ctx.policy
    history_now = history_tokens(ctx.counter, state)
    documents_now = passages_tokens(ctx.counter, state.passages)
    history_kept = min(history_now, policy.history.max_tokens)
    documents_kept = min(documents_now, policy.documents.max_tokens)
    saving = max(0, history_now - history_kept) + max(0, documents_now - documents_kept)
    if policy.rerank.enabled and policy.rerank.top_k and len(state.passages) > policy.rerank.top_k:
        per_passage = documents_now // len(state.passages)
        saving = max(saving, per_passage * (len(state.passages) - policy.rerank.top_k))
    return saving


def drop_least_valuable_unit(state: PipelineState, counter: CachedCounter) -> int | None:
    """Remove one unit and return its estimated tokens (None: nothing left to cut). History over its
    budget loses its oldest turn (a tool exchange goes whole), otherwise the lowest-scored passage sentence goes, then the
    summary, then the oldest turns."""
    over_history = history_tokens(counter, state) > state.history_budget
    if over_history and state.history:
        return drop_oldest_turns(state, counter)
    if over_history and state.summary:
        return drop_summary(state, counter)
    dropped = drop_lowest_sentence(state.passages)
    if dropped is not None:
        return counter.count(dropped) + 1
    if state.summary:
        return drop_summary(state, counter)
    if state.history:
        return drop_oldest_turns(state, counter)
    return None


def drop_oldest_turns(state: PipelineState, counter: CachedCounter) -> int:
    """Remove the oldest history unit (a turn, or a tool call with its replies: never half of one);
    return its estimated tokens."""
    _, end = turn_units(state.history)[0]
    dropped, state.history = state.history[:end], state.history[end:]
    return sum(turn_cost(counter, m) for m in dropped)


def drop_summary(state: PipelineState, counter: CachedCounter) -> int:
    assert state.summary is not None
    cost = counter.count(state.summary)
    state.summary = None
    return cost
