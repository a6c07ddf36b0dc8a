"""Data that crosses the boundary between the gateway and the compression pipeline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Document:
    text: str
    id: str | None = None
    title: str | None = None
    score: float | None = None  # relevance given by the app or by retrieval


@dataclass
class RetrievalSpec:
    index: str
    top_n: int = 5


@dataclass
class CompressionInput:
    # OpenAI-style messages; the last user message is the question, system messages are kept whole.
    messages: list[dict[str, Any]]
    documents: list[Document] = field(default_factory=list)
    retrieval: RetrievalSpec | None = None
    tenant: str = "anonymous"
    # Applied to retrieved passages' text, title and sentences (the gateway's sanitiser: an index
    # is as untrusted as the client's documents). None: taken as they are.
    neutralise: Callable[[str], str] | None = None
    # The conversation this request continues (the gateway's key: the tenant's salt with the system
    # prompt and first user turn, or the client's conversation id). None: no conversation memory.
    conversation: str | None = None


@dataclass
class StageReport:
    name: str
    saved_tokens: int = 0
    ms: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompressionResult:
    messages: list[dict[str, Any]]  # exactly what is sent to the model
    original_prompt_tokens: int  # chat-templated prompt with every document inline, uncompressed
    prompt_tokens: int  # chat-templated prompt actually sent (<= policy.max_input_tokens)
    stages: list[StageReport] = field(default_factory=list)
    kept_documents: list[Document] = field(default_factory=list)
    context_text: str = ""  # the assembled passages block as sent
    # Time the request waited for a free compression worker before its stages ran (not in the stages'
    # `compression_ms`): what a small worker budget costs a burst of requests.
    wait_ms: float = 0.0
    # Time its embedding passes held the in-process engine's thread (ctxgate.compression.embedding.batching.EngineTime):
    # part of `compression_ms`, and time every request running in the engine waited.
    engine_ms: float = 0.0
    # Time the stages waited for embeddings (the model's first load included), taken out of the
    # stages' own `ms` and shown as `compression_ms["embedding"]`.
    embedding_ms: float = 0.0
    # The measured prefill cost the cost check used (PrefillCostEstimator): what a saved token is worth.
    prefill_ms_per_token: float = 0.0
    # The messages of `original_prompt_tokens` (every document inline, the whole history): what a shadow
    # request answers to measure what compression changed (gateway/shadow/). None: not built.
    original_messages: list[dict[str, Any]] | None = None
    # Tokens per segment (ctxgate.compression.segments) of the original and the sent prompt, each
    # adding up to its count; the gateway adds the tools the template renders beside the messages.
    segments_original: dict[str, int] = field(default_factory=dict)
    segments_sent: dict[str, int] = field(default_factory=dict)

    @property
    def saved_tokens(self) -> dict[str, int]:
        return {stage.name: stage.saved_tokens for stage in self.stages}

    @property
    def saved_tokens_total(self) -> int:
        return self.original_prompt_tokens - self.prompt_tokens

    @property
    def reduction(self) -> float:
        """How many times fewer prompt tokens were sent than the request had (2 decimals)."""
        return round(self.original_prompt_tokens / self.prompt_tokens, 2) if self.prompt_tokens else 0.0

    @property
    def estimated_prefill_ms_saved(self) -> float:
        return round(self.saved_tokens_total * self.prefill_ms_per_token, 1)

    @property
    def message_context(self) -> dict[str, Any] | None:
        """What the message-context stage found inside the messages and how much of it is sent."""
        report = next((stage for stage in self.stages if stage.name == "message-context"), None)
        return dict(report.details) if report is not None else None

    @property
    def compression_ms(self) -> dict[str, float]:
        """Per stage, and the embedding every stage waited for under its own key; they add up to the
        compression's whole time."""
        times = {stage.name: round(stage.ms, 3) for stage in self.stages}
        return times | {"embedding": round(self.embedding_ms, 3)} if self.stages else times


class BudgetExceededError(Exception):
    """The parts that are never cut (system prompt, question) alone exceed the budget -> HTTP 413."""

    def __init__(self, message: str, required_tokens: int, budget_tokens: int):
        super().__init__(message)
        self.required_tokens = required_tokens
        self.budget_tokens = budget_tokens
