"""The prompt renderer: the only place that knows how the sent prompt is laid out.

Everything that turns passages, a history summary and the question into messages lives here, and
so does the list of markers the layout starts a line with (`LINE_MARKERS`): the gateway's
sanitizer imports that list, so client text can never forge a marker the renderer emits.

The original prompt (all documents, full history) is rendered with the same functions as the sent
one, so the "original" and "sent" token counts are comparable.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ctxgate.compression.segments import Layout
from ctxgate.compression.state import Passage, PipelineState, message_text
from ctxgate.compression.text import content_hash
from ctxgate.policies.schema import AssemblyPolicy

CONTEXT_HEADER = "Documents:"
QUESTION_HEADER = "Question:"
SUMMARY_HEADER = "Summary of the earlier conversation:"
PASSAGE_SEPARATOR = "\n\n"

# Every marker a rendered line can start with, as a regular expression. A passage header is
# "[n]" or "[n] Title"; its number is the marker.
LINE_MARKERS: tuple[str, ...] = (
    re.escape(CONTEXT_HEADER),
    re.escape(QUESTION_HEADER),
    re.escape(SUMMARY_HEADER),
    r"\[\d+\]",
)


def passage_header(number: int, title: str | None) -> str:
    return f"[{number}] {title}" if title else f"[{number}]"


def passage_header_cost(count: Callable[[str], int], number: int, passage: Passage, keep_title: bool) -> int:
    """Tokens a passage adds to the block besides its sentences."""
    header = passage_header(number, passage.title if keep_title else None)
    return count(header) + 2  # the header's newline and the blank line between passages


def render_passage(number: int, passage: Passage, keep_title: bool = True) -> str:
    if passage.frame is not None:  # found inside a message: its own header and tags, as the client wrote them
        return f"{passage.frame[0]}{passage.body()}{passage.frame[1]}"
    return f"{passage_header(number, passage.title if keep_title else None)}\n{passage.body()}"


def render_context(passages: list[Passage], keep_titles: bool = True) -> str:
    """The passages block: non-empty passages numbered from 1, in the given order."""
    visible = [passage for passage in passages if not passage.is_empty()]
    return PASSAGE_SEPARATOR.join(render_passage(i + 1, p, keep_titles) for i, p in enumerate(visible))


def context_message(context_text: str) -> dict[str, Any]:
    """The passages block as its own system message (placement "system")."""
    return {"role": "system", "content": f"{CONTEXT_HEADER}\n{context_text}"}


def question_with_context(context_text: str, question_text: str) -> str:
    """The passages block before the question in the same user turn (placement "user")."""
    return f"{CONTEXT_HEADER}\n{context_text}\n\n{QUESTION_HEADER} {question_text}"


def summary_text(summary: str) -> str:
    """The summary as quoted material: one "> " line, whitespace collapsed, so the (client-derived)
    text can neither start a line of its own nor look like anything but a quote."""
    return f"{SUMMARY_HEADER}\n> {' '.join(summary.split())}"


def summary_message(summary: str) -> dict[str, Any]:
    """The summary where the summarized turns were, as a *user* turn: it is derived from client text
    (verbatim in the extractive fallback), which must never gain a system message's authority."""
    return {"role": "user", "content": summary_text(summary)}


def order_passages(passages: list[Passage], order: str) -> list[Passage]:
    """Counter "lost in the middle": best first, or best at both ends of the block."""
    if order == "original":
        return sorted(passages, key=lambda p: p.position)
    if order == "stable":
        # Content decides, not the question or the scores: a passage two requests share sits at the
        # same place relative to the other shared ones, so their prompts share a prefix.
        return sorted(passages, key=lambda p: (content_hash(p.document.text), p.position))
    ranked = sorted(passages, key=lambda p: (-p.score, p.position))
    if order == "best-first":
        return ranked
    front: list[Passage] = []
    back: list[Passage] = []
    for rank, passage in enumerate(ranked):
        (front if rank % 2 == 0 else back).append(passage)
    return front + back[::-1]


def render_messages(
    state: PipelineState,
    context_text: str,
    history: list[dict[str, Any]],
    summary: str | None,
    assembly: AssemblyPolicy,
    slot_texts: dict[int, str] | None = None,
) -> list[dict[str, Any]]:
    """The messages sent to the model: system prompt, context, summary, history, question, trailing.
    Context found inside messages goes back where each block was found instead of the assembly
    placement: `slot_texts` holds each block's text by slot index (see `render_slots`); without it,
    `context_text` goes into the first block and the others stay empty."""
    return render_prompt(state, context_text, history, summary, assembly, slot_texts)[0]


def render_prompt(
    state: PipelineState,
    context_text: str,
    history: list[dict[str, Any]],
    summary: str | None,
    assembly: AssemblyPolicy,
    slot_texts: dict[int, str] | None = None,
) -> tuple[list[dict[str, Any]], list[Layout]]:
    """`render_messages`, with each message's `Layout` (which segment its text is, where passages
    went into it): what per-segment accounting counts (ctxgate.compression.segments)."""
    slots = state.context_slots
    if slots and slot_texts is None:
        slot_texts = {0: context_text}
    messages: list[dict[str, Any]] = [dict(m) for m in state.system_messages]
    question = dict(state.question)
    # Where each slot's block goes: (offset before any block went in, length), per message.
    inserted: dict[tuple[str, int], list[tuple[int, int]]] = {}
    # Last offset first, so the earlier offsets into the same message stay valid.
    for number in sorted(range(len(slots)), key=lambda n: -slots[n].offset):
        slot, text = slots[number], (slot_texts or {}).get(number, "")
        where = ("system", slot.index) if slot.where == "system" else ("question", 0)
        inserted.setdefault(where, []).append((slot.offset, len(text)))
        if slot.where == "system":
            messages[slot.index] = in_slot(messages[slot.index], slot.offset, text)
        else:
            question = in_slot(question, slot.offset, text)
    layouts = [Layout("system", _block_ranges(inserted.get(("system", i), []))) for i in range(len(messages))]
    if not slots and context_text and assembly.placement == "system":
        messages.append(context_message(context_text))
        layouts.append(Layout("documents"))
    if summary:
        messages.append(summary_message(summary))
        layouts.append(Layout("history"))
    messages.extend(dict(m) for m in history)
    layouts.extend(Layout("history") for _ in history)
    question_layout = Layout("question", _block_ranges(inserted.get(("question", 0), [])))
    if not slots and context_text and assembly.placement == "user":
        # The question text itself is untouched: the context goes before it in the same turn.
        question["content"] = question_with_context(context_text, message_text(state.question))
        block = len(question_with_context(context_text, "")) - len(QUESTION_HEADER) - 1
        question_layout = Layout("question", ((0, block),))
    messages.append(question)
    layouts.append(question_layout)
    # Turns after the question (tool calls and their results) are conversation: history.
    messages.extend(dict(m) for m in state.trailing)
    layouts.extend(Layout("history") for _ in state.trailing)
    return messages, layouts


def _block_ranges(insertions: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Each inserted block's (start, end) in the final content: an earlier block shifts the later."""
    ranges: list[tuple[int, int]] = []
    shift = 0
    for offset, length in sorted(insertions):
        ranges.append((offset + shift, offset + shift + length))
        shift += length
    return tuple(ranges)


def render_slots(passages: list[Passage], keep_titles: bool = True) -> dict[int, str]:
    """Each found block's text by slot index: its passages in the given order. Passages that came
    without a block (the `documents` field) join the first block."""
    by_slot: dict[int, list[Passage]] = {}
    for passage in passages:
        by_slot.setdefault(passage.slot or 0, []).append(passage)
    return {slot: render_context(members, keep_titles) for slot, members in by_slot.items()}


def in_slot(message: dict[str, Any], offset: int, context_text: str) -> dict[str, Any]:
    """`message` with the passages block put back at `offset` of its content."""
    content = message_text(message)
    return {**message, "content": content[:offset] + context_text + content[offset:]}
