"""What flows between stages: the request split into pinned parts and cuttable units."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compression.types import CompressionInput, Document


def message_text(message: dict[str, Any]) -> str:
    """Content as plain text (OpenAI content parts are joined)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
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

    @property
    def text(self) -> str:
        return self.document.text

    @property
    def title(self) -> str | None:
        return self.document.title

    def body(self) -> str:
        if self.sentences is None:
            return self.document.text
        if self.kept_sentences is None:
            if not self.removed_sentences:
                return self.document.text
            indices = [i for i in range(len(self.sentences)) if i not in self.removed_sentences]
        else:
            indices = sorted(self.kept_sentences)
        return " ".join(self.sentences[i] for i in indices)

    def is_empty(self) -> bool:
        return not self.body().strip()


@dataclass
class PipelineState:
    system_messages: list[dict[str, Any]]
    history: list[dict[str, Any]]
    question: dict[str, Any]
    trailing: list[dict[str, Any]]
    passages: list[Passage]
    tenant: str
    summary: str | None = None
    question_vector: np.ndarray | None = None
    retrieval: Any = None
    # Filled by the pipeline before the stages run.
    budget_tokens: int = 0
    pinned_tokens: int = 0
    history_budget: int = 0

    @property
    def question_text(self) -> str:
        return message_text(self.question)


def split_messages(request: CompressionInput) -> PipelineState:
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
        retrieval=request.retrieval,
    )
