"""The single place that turns the pipeline state into the messages sent to the model.

The original prompt (all documents, full history) is rendered with the same functions, so the
"original" and "sent" token counts are comparable.
"""

from __future__ import annotations

from typing import Any

from compression.state import Passage, PipelineState, message_text
from policies.schema import AssemblyPolicy

CONTEXT_HEADER = "Documents:"
QUESTION_HEADER = "Question:"
SUMMARY_HEADER = "Summary of the earlier conversation:"


def render_passage(number: int, passage: Passage, keep_title: bool = True) -> str:
    header = f"[{number}]"
    if keep_title and passage.title:
        header += f" {passage.title}"
    return f"{header}\n{passage.body()}"


def render_context(passages: list[Passage], keep_titles: bool = True) -> str:
    visible = [passage for passage in passages if not passage.is_empty()]
    return "\n\n".join(render_passage(i + 1, p, keep_titles) for i, p in enumerate(visible))


def order_passages(passages: list[Passage], order: str) -> list[Passage]:
    """Counter "lost in the middle": best first, or best at both ends of the block."""
    if order == "original":
        return sorted(passages, key=lambda p: p.position)
    ranked = sorted(passages, key=lambda p: (-p.score, p.position))
    if order == "best-first":
        return ranked
    front: list[Passage] = []
    back: list[Passage] = []
    for rank, passage in enumerate(ranked):
        (front if rank % 2 == 0 else back).append(passage)
    return front + back[::-1]


def build_messages(
    state: PipelineState,
    context_text: str,
    history: list[dict[str, Any]],
    summary: str | None,
    assembly: AssemblyPolicy,
) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [dict(m) for m in state.system_messages]
    if context_text and assembly.placement == "system":
        messages.append({"role": "system", "content": f"{CONTEXT_HEADER}\n{context_text}"})
    if summary:
        messages.append({"role": "system", "content": f"{SUMMARY_HEADER}\n{summary}"})
    messages.extend(dict(m) for m in history)
    question = dict(state.question)
    if context_text and assembly.placement == "user":
        # The question text itself is untouched: the context goes before it in the same turn.
        question["content"] = (
            f"{CONTEXT_HEADER}\n{context_text}\n\n{QUESTION_HEADER} {message_text(state.question)}"
        )
    messages.append(question)
    messages.extend(dict(m) for m in state.trailing)
    return messages
