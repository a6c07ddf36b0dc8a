"""The pipeline interface the gateway calls, and the budget-only pipeline used when no compressor is given.

Any object with `async run(CompressionInput, Policy) -> CompressionResult` will do (the compression
package's `CompressionPipeline` is one). `BudgetOnlyPipeline` has no compression stages: it places
the documents, then drops whole documents from the end, then the oldest history turns, until the
chat-templated prompt fits `max_input_tokens` exactly. The system prompt and the question are never
cut; if they alone do not fit it raises BudgetExceededError (HTTP 413). The documents are laid out by
`compression.rendering`, the one renderer.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from compression.rendering import context_message, question_with_context, render_context
from compression.state import Passage, message_text
from compression.types import BudgetExceededError, CompressionInput, CompressionResult, Document, StageReport
from policies.schema import Policy


class Pipeline(Protocol):
    async def run(self, inp: CompressionInput, policy: Policy) -> CompressionResult: ...


class ChatTokenizer(Protocol):
    def count(self, text: str) -> int: ...

    def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int: ...


def format_documents(documents: list[Document]) -> str:
    """The passages block, rendered by the compression package's renderer (the one layout)."""
    return render_context([Passage(document=document, position=i) for i, document in enumerate(documents)])


def split_messages(messages: list[dict[str, Any]]) -> tuple[list[dict], list[dict], dict | None]:
    """(system messages, history turns, question): the question is the last user message."""
    question_index = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    system = [m for m in messages if m.get("role") in ("system", "developer")]
    history = [
        m for i, m in enumerate(messages) if m.get("role") not in ("system", "developer") and i != question_index
    ]
    question = messages[question_index] if question_index is not None else None
    return system, history, question


def assemble_messages(
    messages: list[dict[str, Any]], documents: list[Document], placement: str
) -> list[dict[str, Any]]:
    """The messages with the passages placed as the policy says; without documents, unchanged."""
    if not documents:
        return [dict(m) for m in messages]
    context = format_documents(documents)
    system, history, question = split_messages(messages)
    if placement == "system" or question is None:
        result = [dict(m) for m in system] + [context_message(context)]
        result += [dict(m) for m in messages if m.get("role") not in ("system", "developer")]
        return result
    asked = dict(question)
    asked["content"] = question_with_context(context, message_text(question))
    return [dict(m) if m is not question else asked for m in messages]


class BudgetOnlyPipeline:
    """Exact budget enforcement with no compression stages (a fallback and the passthrough path)."""

    def __init__(self, tokenizer: ChatTokenizer):
        self.tokenizer = tokenizer

    def _count(self, messages: list[dict[str, Any]]) -> int:
        return self.tokenizer.count_chat(messages)

    def _fits_documents(self, policy: Policy, docs: list[Document]) -> bool:
        if not policy.compression_enabled:
            return True
        if policy.documents.max_documents is not None and len(docs) > policy.documents.max_documents:
            return False
        return not docs or self.tokenizer.count(format_documents(docs)) <= policy.documents.max_tokens

    def _largest_prefix(self, count_for: int, fits) -> int:
        """Largest k in [0, count_for] with fits(k); fits is monotone (fewer items never hurts)."""
        low, high = 0, count_for
        while low < high:
            middle = (low + high + 1) // 2
            if fits(middle):
                low = middle
            else:
                high = middle - 1
        return low

    async def run(self, inp: CompressionInput, policy: Policy) -> CompressionResult:
        if inp.retrieval is not None:
            raise ValueError("retrieval is not available in this gateway (no index service); send documents")
        budget = policy.max_input_tokens
        placement = policy.assembly.placement
        messages = inp.messages
        documents = list(inp.documents)
        original_tokens = self._count(assemble_messages(messages, documents, placement))

        started = time.perf_counter()
        kept = self._largest_prefix(
            len(documents),
            lambda k: self._fits_documents(policy, documents[:k])
            and self._count(assemble_messages(messages, documents[:k], placement)) <= budget,
        )
        documents = documents[:kept]
        after_documents = self._count(assemble_messages(messages, documents, placement))
        documents_stage = StageReport(
            "documents",
            saved_tokens=original_tokens - after_documents,
            ms=(time.perf_counter() - started) * 1000,
            details={"dropped_documents": len(inp.documents) - kept},
        )

        started = time.perf_counter()
        system, history, question = split_messages(messages)
        dropped_turns = 0
        if after_documents > budget and history:
            # Drop the oldest turns first; the system prompt and the question stay whole.
            def without_oldest(k: int) -> list[dict[str, Any]]:
                removed = {id(m) for m in history[:k]}
                return [m for m in messages if id(m) not in removed]

            dropped_turns = len(history) - self._largest_prefix(
                len(history),
                lambda keep: self._count(assemble_messages(without_oldest(len(history) - keep), documents, placement))
                <= budget,
            )
            messages = without_oldest(dropped_turns)
        final_messages = assemble_messages(messages, documents, placement)
        prompt_tokens = self._count(final_messages)
        history_stage = StageReport(
            "history",
            saved_tokens=after_documents - prompt_tokens,
            ms=(time.perf_counter() - started) * 1000,
            details={"dropped_turns": dropped_turns},
        )
        if prompt_tokens > budget:
            raise BudgetExceededError(
                f"the system prompt and question alone need {prompt_tokens} tokens, more than the policy "
                f"'{policy.name}' allows (max_input_tokens={budget})",
                required_tokens=prompt_tokens,
                budget_tokens=budget,
            )
        return CompressionResult(
            messages=final_messages,
            original_prompt_tokens=original_tokens,
            prompt_tokens=prompt_tokens,
            stages=[history_stage, documents_stage],
            kept_documents=documents,
            context_text=format_documents(documents),
        )
