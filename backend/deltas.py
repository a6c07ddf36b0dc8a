"""What one request's stream of `GenerationDelta`s adds up to, for every consumer of an engine
(the engine's own server, the gateway, the benchmarks): text, token counts, finish reason, metrics.

The finish reason a client sees is OpenAI's: "length" when the token limit cut the answer, else
"stop" (a stop string, EOS, or an abort that only a departed client could have caused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend.api import GenerationDelta, RequestMetrics


def openai_finish_reason(engine_reason: str) -> str:
    return "length" if engine_reason == "length" else "stop"


@dataclass
class DeltaTotals:
    prompt_tokens: int = 0  # what the caller sent; the engine's final count replaces it when it gives one
    completion_tokens: int = 0
    finish_reason: str | None = None  # OpenAI's; None until the final delta arrived
    metrics: RequestMetrics | None = None  # the engine's timings, on the final delta
    upstream_usage: dict[str, Any] | None = None  # an upstream server's own `usage` object
    _text_parts: list[str] = field(default_factory=list)

    def add(self, delta: GenerationDelta) -> None:
        if delta.text:
            self._text_parts.append(delta.text)
        self.completion_tokens += len(delta.token_ids)
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
        return "".join(self._text_parts)

    @property
    def cached_prompt_tokens(self) -> int:
        return self.metrics.cached_prompt_tokens if self.metrics is not None else 0
