"""What one request's stream of `GenerationDelta`s adds up to, for every consumer of an engine
(the engine's own server, the gateway, the benchmarks): text, token counts, finish reason, metrics.

The finish reason a client sees is OpenAI's: "length" when the token limit cut the answer, else
"stop" (a stop string, EOS, or an abort that only a departed client could have caused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxgate.backend.engine.api import GenerationDelta, RequestMetrics, TokenLogprob


def openai_finish_reason(engine_reason: str) -> str:
    return "length" if engine_reason == "length" else "stop"


@dataclass
class ChoiceTotals:
    """What one choice's deltas add up to."""

    index: int
    finish_reason: str | None = None  # OpenAI's
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass
class DeltaTotals:
    prompt_tokens: int = 0  # what the caller sent; the engine's final count replaces it when it gives one
    completion_tokens: int = 0
    finish_reason: str | None = None  # OpenAI's; None until the final delta arrived
    metrics: RequestMetrics | None = None  # the engine's timings, on the final delta
    upstream_usage: dict[str, Any] | None = None  # an upstream server's own `usage` object
    choices: dict[int, ChoiceTotals] = field(default_factory=dict)

    def choice(self, index: int) -> ChoiceTotals:
        found = self.choices.get(index)
        if found is None:
            found = self.choices[index] = ChoiceTotals(index)
        return found

    def add(self, delta: GenerationDelta) -> None:
        choice = self.choice(delta.index)
        if delta.text:
            choice.text_parts.append(delta.text)
        if delta.logprobs:
            choice.logprobs.extend(delta.logprobs)
        self.completion_tokens += len(delta.token_ids)
        reason = delta.choice_finish_reason or delta.finish_reason
        if reason is not None and choice.finish_reason is None:
            choice.finish_reason = openai_finish_reason(reason)
        if delta.finish_reason is None:
            return
        self.finish_reason = openai_finish_reason(delta.finish_reason)
        if delta.prompt_tokens:
            self.prompt_tokens = delta.prompt_tokens
        if delta.completion_tokens:
            self.completion_tokens = delta.completion_tokens
        self.metrics = delta.metrics
        self.upstream_usage = delta.usage

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The first choice's text."""
        return self.choice(0).text

    def ordered_choices(self) -> list[ChoiceTotals]:
        self.choice(0)
        return [self.choices[index] for index in sorted(self.choices)]

    @property
    def cached_prompt_tokens(self) -> int:
        return self.metrics.cached_prompt_tokens if self.metrics is not None else 0
