"""The conversation stage: earlier turns as they were sent, a summary rolled forward in fixed steps,
and no passage sentence sent twice.

Rule: the history messages that match the conversation's memory (compression/conversation.py) are
rendered exactly as they were sent (a question turn with the passages block it had), so the previous
prompt is a prefix of this one; when the carried turns outgrow their room (at most
`max_carried_tokens`), they roll at once: all but the last `history.keep_last_turns` messages leave
and their summary is appended to the summary (never rewritten), so the prefix changes only at those
steps. A sentence of the new passages that the carried turns
already hold is dropped: the budget goes to new evidence. `remember` stores what was sent, after
the fit. The history stage stands aside for a request this stage carried.
"""

from __future__ import annotations

from typing import Any

from ctxgate.compression.conversation import (
    CarriedTurns,
    ConversationRecord,
    SentTurn,
    matched_turns,
    sent_sentences,
    sentence_digest,
    turn_digest,
)
from ctxgate.compression.history import is_tool_unit, turn_units
from ctxgate.compression.rendering import question_with_context, render_context
from ctxgate.compression.stages.base import Stage, StageContext
from ctxgate.compression.stages.budget import history_tokens, passages_tokens
from ctxgate.compression.stages.history import MIN_SUMMARY_TOKENS
from ctxgate.compression.stages.prepare import ensure_sentences
from ctxgate.compression.state import PipelineState, message_text
from ctxgate.compression.types import StageReport
from ctxgate.policies.schema import Policy


class ConversationStage(Stage):
    """Carries the conversation's earlier turns as they were sent, and drops already-sent sentences."""

    name = "conversation"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        # The passages must go into the question's turn, where the next request finds them again in
        # the history: a system block or blocks found inside messages are not carried.
        return (
            state.compressing
            and policy.conversation.enabled
            and state.conversation is not None
            and policy.assembly.placement == "user"
            and not state.context_slots
            and not state.trailing
        )

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        assert state.conversation is not None
        policy = ctx.policy.conversation
        report = StageReport(self.name)
        if sum(m.get("role") == "user" for m in state.history) + 1 > policy.max_turns:
            report.details["skipped"] = f"over max_turns {policy.max_turns}"
            return report
        before = history_tokens(ctx.counter, state) + passages_tokens(ctx.counter, state.passages)
        record = ctx.services.conversations.load(state.tenant, state.conversation)
        matched = matched_turns(state.history, record)
        turns = [
            record.turns[i] if record is not None and i < matched else SentTurn(turn_digest(message))
            for i, message in enumerate(state.history)
        ]
        # The summary stands for turns this history still begins with; a history that branched off
        # before the summary's end starts over, every turn carried as written.
        start, summary = 0, None
        if record is not None and record.start <= matched:
            start, summary = record.start, record.summary
        original = state.history
        rendered = [as_sent(message, turn) for message, turn in zip(original, turns, strict=True)]
        state.history_budget = carried_budget(state, ctx)
        state.summary = summary
        state.history = rendered[start:]
        start = await roll_forward(state, ctx, original, rendered, turns, start)
        state.carried = CarriedTurns(turns, start, matched, policy.ttl_s)
        sentences, passages = drop_sent_sentences(state, ctx, turns[start:])
        report.details.update(
            matched_turns=matched,
            carried_from=start,
            sent_sentences_dropped=sentences,
            sent_passages_dropped=passages,
        )
        report.saved_tokens = (
            before - history_tokens(ctx.counter, state) - passages_tokens(ctx.counter, state.passages)
        )
        return report


def as_sent(message: dict[str, Any], turn: SentTurn) -> dict[str, Any]:
    """A history message as it was sent: a question turn with the passages block it had."""
    if turn.context is None:
        return dict(message)
    return {**message, "content": question_with_context(turn.context, message_text(message))}


def carried_budget(state: PipelineState, ctx: StageContext) -> int:
    """The carried turns' room: what the pinned parts and a full passages block for the new turn
    leave, at most `max_carried_tokens`, and never less than the history budget (within the whole
    budget)."""
    policy = ctx.policy
    room = state.budget_tokens - state.pinned_tokens
    new_block = policy.documents.max_tokens if state.passages else 0
    carried = room - new_block
    if policy.conversation.max_carried_tokens is not None:
        carried = min(carried, policy.conversation.max_carried_tokens)
    return max(0, min(room, max(policy.history.max_tokens, carried)))


async def roll_forward(
    state: PipelineState,
    ctx: StageContext,
    original: list[dict[str, Any]],
    rendered: list[dict[str, Any]],
    turns: list[SentTurn],
    start: int,
) -> int:
    """When the carried turns outgrow their room they roll at once: every turn but the last
    `history.keep_last_turns` messages (widened to a whole unit) leaves into the summary, and the
    kept ones are sent from then on as the client wrote them, without their passages. A roll makes
    the engine prefill everything after the summary again, so it leaves that part as small as the
    history without memory would be. Should the kept turns still not fit, they leave one unit at a
    time. Returns the new first carried turn."""
    if history_tokens(ctx.counter, state) <= state.history_budget:
        return start
    boundaries = [unit_start for unit_start, _ in turn_units(original)] + [len(original)]
    keep_from = max(start, len(original) - ctx.policy.history.keep_last_turns)
    new_start = max([start] + [b for b in boundaries if b <= keep_from])
    for index in range(new_start, len(original)):
        turns[index] = SentTurn(turns[index].digest)
        rendered[index] = dict(original[index])
    while True:
        state.summary = await extended_summary(state, ctx, leaving_messages(original, start, new_start))
        start = new_start
        state.history = rendered[start:]
        if start >= len(original) or history_tokens(ctx.counter, state) <= state.history_budget:
            return start
        new_start = next(b for b in boundaries if b > start)


def leaving_messages(original: list[dict[str, Any]], start: int, end: int) -> list[dict[str, Any]]:
    """The messages of original[start:end] the summary covers (a tool exchange is not summarized)."""
    window = original[start:end]
    return [
        message
        for unit in turn_units(window)
        if not is_tool_unit(window, unit)
        for message in window[unit[0] : unit[1]]
    ]


async def extended_summary(
    state: PipelineState, ctx: StageContext, leaving: list[dict[str, Any]]
) -> str | None:
    """The summary with the leaving turns' summary appended (within `summary_max_tokens`); once it is
    full, or under `truncate`, the leaving turns are dropped and the summary stays as it was.

    The appended part is extractive (or an engine summary of the same turns already cached): a roll
    already makes the engine prefill every carried turn after it again, and generating a summary
    there would add a whole generation to that turn's time to first token."""
    policy = ctx.policy.history
    summary = state.summary
    used = ctx.counter.count(summary) + 1 if summary else 0
    room = policy.summary_max_tokens - used
    if not leaving or policy.strategy == "truncate" or room < MIN_SUMMARY_TOKENS:
        return summary
    outcome = await ctx.services.summarizer.summarize(
        state.tenant,
        leaving,
        "",  # not the question: the same turns give the same summary whatever is asked next
        room,
        policy.summary_timeout_s,
        use_engine=False,
    )
    if not outcome.text:
        return summary
    return f"{summary} {outcome.text}" if summary else outcome.text


def drop_sent_sentences(state: PipelineState, ctx: StageContext, window: list[SentTurn]) -> tuple[int, int]:
    """Drop the new passages' sentences that the carried turns already hold; (sentences, passages)."""
    already = {digest for turn in window for digest in turn.sentences}
    if not already or not state.passages:
        return 0, 0
    ensure_sentences(ctx, state.passages)
    dropped = 0
    for passage in state.passages:
        for index, sentence in enumerate(passage.sentences or []):
            if index not in passage.removed_sentences and sentence_digest(sentence) in already:
                passage.removed_sentences.add(index)
                dropped += 1
    kept = [passage for passage in state.passages if not passage.is_empty()]
    emptied = len(state.passages) - len(kept)
    state.passages = kept
    return dropped, emptied


def remember(state: PipelineState, ctx: StageContext) -> None:
    """Store how this request's turns were sent (after the fit, which may have dropped the oldest
    carried turns or the summary): the next turn of the conversation sends them again as they are."""
    carried = state.carried
    assert carried is not None and state.conversation is not None
    first_sent = len(carried.turns) - len(state.history)
    passages = [passage for passage in state.passages if not passage.is_empty()]
    context = render_context(passages, ctx.policy.extraction.keep_titles) or None
    question = SentTurn(turn_digest(state.question), context, sent_sentences(passages) if context else [])
    # Turns before the first one sent keep only their digest: memory holds what the prompt holds.
    turns = [turn if i >= first_sent else SentTurn(turn.digest) for i, turn in enumerate(carried.turns)]
    record = ConversationRecord([*turns, question], first_sent, state.summary)
    ctx.services.conversations.save(state.tenant, state.conversation, record, carried.ttl_s)
