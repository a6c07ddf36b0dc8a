"""Per-segment accounting: a prompt's tokens split into what they are for (system, history,
documents, tools, question), adding up exactly to the prompt's count.

The renderer (`ctxgate.compression.rendering.render_prompt`) states, per message it builds, which
segment its text belongs to (`Layout`: the message's own segment, and the character ranges of its
content that are passages). The chat template's text is then cut at those boundaries and each piece
counted with the same tokenizer; the template's own tokens count with the turn they open (the
prompt's opening, a template's default system prompt included, as system; the closing and the
generation prompt as the question). A tokenizer may merge a token or two across a boundary: that
difference goes to the largest segment, so the segments add up to the prompt's count exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ctxgate.compression.counting import CachedCounter
from ctxgate.compression.state import message_text

Segment = Literal["system", "history", "documents", "tools", "question"]
PROMPT_SEGMENTS: tuple[Segment, ...] = ("system", "history", "documents", "tools", "question")


@dataclass(frozen=True)
class Layout:
    """One message's segments: `segment` for its whole text (and its framing), except the character
    ranges of its content in `documents` (passages put into it)."""

    segment: Segment
    documents: tuple[tuple[int, int], ...] = field(default_factory=tuple)


def zero() -> dict[str, int]:
    return dict.fromkeys(PROMPT_SEGMENTS, 0)


def balanced(counts: Mapping[str, int], total: int) -> dict[str, int]:
    """`counts` adjusted to add up to `total` exactly: the difference goes to the largest segments
    (never below zero), which is where a tokenizer's merges across boundaries came from."""
    result = zero() | {name: max(0, value) for name, value in counts.items()}
    residual = max(0, total) - sum(result.values())
    for name in sorted(result, key=lambda n: -result[n]):
        if residual == 0:
            break
        change = max(residual, -result[name])
        result[name] += change
        residual -= change
    return result


def segment_tokens(
    counter: CachedCounter, messages: Sequence[dict[str, Any]], layouts: Sequence[Layout], total: int
) -> dict[str, int]:
    """Tokens per segment of the chat prompt of `messages` (each described by its `Layout`), adding
    up to `total`, the prompt's exact count."""
    rendered = counter.counter.render_chat(list(messages))
    if rendered is None:
        return balanced(_per_message(counter, messages, layouts), total)
    pieces = _pieces(rendered, messages, layouts)
    counts = counter.counter.count_many([rendered[start:end] for _, start, end in pieces])
    by_segment = zero()
    for (segment, _, _), count in zip(pieces, counts, strict=True):
        by_segment[segment] += count
    return balanced(by_segment, total)


def _pieces(
    rendered: str, messages: Sequence[dict[str, Any]], layouts: Sequence[Layout]
) -> list[tuple[Segment, int, int]]:
    """The rendered prompt cut into (segment, start, end) pieces covering it, adjacent pieces of one
    segment merged. Each message's content is found in order; a content the template changed beyond
    recognition gets no piece of its own (its text counts with the next one found)."""
    cuts: list[tuple[Segment, int, int]] = []
    cursor = 0  # where the last found content ended
    opened = False
    for message, layout in zip(messages, layouts, strict=True):
        content = message_text(message)
        found = _find(rendered, content, cursor)
        if found is None:
            continue
        start, shift, length = found
        # The turn's framing (and anything unfound before it) counts with this turn; the prompt's
        # opening before the first turn counts as system.
        if not opened:
            cuts.append(("system", 0, start))
            opened = True
        else:
            cuts.append((layout.segment, cursor, start))
        cuts.extend(_content_pieces(layout, start, shift, length))
        cursor = start + length
    cuts.append(("question", cursor, len(rendered)))
    merged: list[tuple[Segment, int, int]] = []
    for segment, start, end in cuts:
        if end <= start:
            continue
        if merged and merged[-1][0] == segment and merged[-1][2] == start:
            merged[-1] = (segment, merged[-1][1], end)
        else:
            merged.append((segment, start, end))
    return merged


def _find(rendered: str, content: str, cursor: int) -> tuple[int, int, int] | None:
    """(where the content starts in `rendered`, how many leading characters the template trimmed,
    its length there), searching from `cursor`; a template may trim a message's ends."""
    if not content.strip():
        return None
    at = rendered.find(content, cursor)
    if at >= 0:
        return at, 0, len(content)
    stripped = content.strip()
    at = rendered.find(stripped, cursor)
    if at < 0:
        return None
    return at, len(content) - len(content.lstrip()), len(stripped)


def _content_pieces(layout: Layout, start: int, shift: int, length: int) -> list[tuple[Segment, int, int]]:
    pieces: list[tuple[Segment, int, int]] = []
    position = start
    end = start + length
    for doc_start, doc_end in sorted(layout.documents):
        lo = min(end, max(start, start + doc_start - shift))
        hi = min(end, max(start, start + doc_end - shift))
        pieces.append((layout.segment, position, lo))
        pieces.append(("documents", lo, hi))
        position = hi
    pieces.append((layout.segment, position, end))
    return pieces


def _per_message(
    counter: CachedCounter, messages: Sequence[dict[str, Any]], layouts: Sequence[Layout]
) -> dict[str, int]:
    """A per-message count (no one rendered text): each message's share of the chat count, its
    passages' text moved to documents."""
    counts = zero()
    empty = counter.count_chat([], add_generation_prompt=False)
    # The generation prompt (reply priming) counts with the question, as in a rendered prompt.
    counts["question"] += counter.count_chat([], add_generation_prompt=True) - empty
    for message, layout in zip(messages, layouts, strict=True):
        share = counter.count_chat([message], add_generation_prompt=False) - empty
        content = message_text(message)
        passages = min(share, sum(counter.count(content[a:b]) for a, b in layout.documents))
        counts["documents"] += passages
        counts[layout.segment] += share - passages
    return counts
