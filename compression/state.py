"""What flows between stages: the request split into pinned parts and cuttable units."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ctxgate.compression.types import CompressionInput, Document, RetrievalSpec

if TYPE_CHECKING:
    from ctxgate.compression.conversation import CarriedTurns
    from ctxgate.compression.segments import Layout


def message_text(message: dict[str, Any]) -> str:
    """Content as plain text (OpenAI content parts are joined by newlines, as the gateway joins them)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


@dataclass
class Passage:
    document: Document
    position: int  # order in the request (or retrieval rank)
    score: float = 0.0  # relevance after rerank (higher is better)
    sentences: list[str] | None = None
    sentence_scores: list[float] | None = None
    removed_sentences: set[int] = field(default_factory=set)  # dedup
    kept_sentences: list[int] | None = None  # extraction; None keeps every (non-removed) sentence
    # Lexical pre-filter: the sentences worth an embedding (None: all of them).
    embed_sentences: set[int] | None = None
    # Found inside a message (ctxgate.compression.context_lifting): the passage's own markup (header, tags)
    # before and after its body, rendered back verbatim around whatever of the body is kept, and the
    # index of its block in `PipelineState.context_slots`.
    frame: tuple[str, str] | None = None
    slot: int | None = None

    @property
    def text(self) -> str:
        return self.document.text

    @property
    def title(self) -> str | None:
        return self.document.title

    def body(self) -> str:
        if self.sentences is None or (self.kept_sentences is None and not self.removed_sentences):
            return self.document.text
        return " ".join(self.body_sentences())

    def body_sentences(self) -> list[str]:
        """The sentences the body holds, in order (every one until a stage removes some)."""
        assert self.sentences is not None, "split the passage first"
        if self.kept_sentences is not None:
            return [self.sentences[i] for i in sorted(self.kept_sentences)]
        return [sentence for i, sentence in enumerate(self.sentences) if i not in self.removed_sentences]

    def is_empty(self) -> bool:
        return not self.body().strip()


def split_passages(passages: list[Passage], split: Callable[[str], list[str]]) -> None:
    """Split each passage not yet split into its sentences (a text with none found is one sentence)."""
    for passage in passages:
        if passage.sentences is None:
            passage.sentences = split(passage.text) or [passage.text]


@dataclass
class ContextSlot:
    """Where a context block found inside a message was: the kept passages are rendered back there
    (`offset` into that message's content, from which the block itself was removed)."""

    where: str  # "system" (state.system_messages[index]) or "question"
    index: int
    offset: int
    layout: str


@dataclass
class RenderedPrompt:
    messages: list[dict[str, Any]]
    tokens: int  # exact, chat-templated
    # Per message, which segment its text is (per-segment accounting); empty: not described.
    layouts: list[Layout] = field(default_factory=list)


@dataclass
class PipelineState:
    """The request as the stages see it; each stage reads and writes the fields named here."""

    system_messages: list[dict[str, Any]]
    history: list[dict[str, Any]]
    question: dict[str, Any]
    trailing: list[dict[str, Any]]
    passages: list[Passage]
    tenant: str
    budget_tokens: int = 0  # policy.max_input_tokens
    retrieval: RetrievalSpec | None = None
    neutralise: Callable[[str], str] | None = None  # CompressionInput.neutralise
    summary: str | None = None
    question_vector: np.ndarray | None = None
    # Set by the cost check, before anything is cut.
    original: RenderedPrompt | None = None  # every document inline, full history
    pinned_tokens: int = 0  # system prompt, question and the context block's own framing
    history_budget: int = 0
    skip_reason: str | None = None  # compression would not pay: the original is sent as it is
    # The lexical pre-filter has chosen which sentences get embedded (it runs once, before the first).
    prefiltered: bool = False
    # Retrieved context found inside messages: where each block's passages go back (empty: none found).
    context_slots: list[ContextSlot] = field(default_factory=list)
    # Set by the fit stage: exactly what is sent.
    sent: RenderedPrompt | None = None
    trimmed_units: int = 0  # units the fit dropped after the stages' estimates
    conversation: str | None = None  # CompressionInput.conversation
    # Set by the conversation stage: the history as the conversation's memory carried it.
    carried: CarriedTurns | None = None

    @property
    def compressing(self) -> bool:
        return self.skip_reason is None

    @property
    def question_text(self) -> str:
        return message_text(self.question)


def split_messages(request: CompressionInput, budget_tokens: int) -> PipelineState:
    """System messages and the last user message are pinned; messages after it are kept too."""
    messages = list(request.messages)
    question_index = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if question_index is None:
        raise ValueError("messages must contain at least one user message (the question)")
    system_messages = [m for m in messages[:question_index] if m.get("role") == "system"]
    history = [m for m in messages[:question_index] if m.get("role") != "system"]
    trailing = messages[question_index + 1 :]
    passages = [Passage(document=document, position=i) for i, document in enumerate(request.documents)]
    return PipelineState(
        system_messages=system_messages,
        history=history,
        question=messages[question_index],
        trailing=trailing,
        passages=passages,
        tenant=request.tenant,
        budget_tokens=budget_tokens,
        retrieval=request.retrieval,
        neutralise=request.neutralise,
        conversation=request.conversation,
    )
