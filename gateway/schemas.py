"""Request bodies of the OpenAI-compatible endpoints, plus ctxgate's extras."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Lenient(BaseModel):
    # Clients (the OpenAI SDK, LangChain, ...) send fields ctxgate does not use; accept and ignore.
    model_config = ConfigDict(extra="allow")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content part of type '{part.type}' is not supported (text only)")
            texts.append(part.text)
        return "".join(texts)


class CtxgateDocument(_Strict):
    text: str
    id: str | int | None = None
    title: str | None = None
    score: float | None = None


class CtxgateRetrieval(_Strict):
    index: str = Field(..., min_length=1)
    top_n: int = Field(5, ge=1, le=100)


class CtxgateExtras(_Strict):
    documents: list[CtxgateDocument] | None = None
    retrieval: CtxgateRetrieval | None = None
    policy: str | None = Field(None, min_length=1)
    priority: Literal["user", "background"] | None = None
    overrides: dict[str, Any] | None = Field(
        None, description="dotted policy fields to override, only those the policy allows"
    )


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Lenient):
    model: str = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=1, description="ctxgate generates one choice per request")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    ctxgate: CtxgateExtras | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop sequences")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] = Field(...)

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt per request")
        return value

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]
