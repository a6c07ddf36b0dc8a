"""Request bodies of `/v1/chat/completions` and `/v1/completions`, with the vLLM-style extras."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ctxgate.backend.engine.sampling_checks import MAX_STOP_SEQUENCES
from ctxgate.backend.openai_api.errors import APIError


class _Lenient(BaseModel):
    # Clients (the OpenAI SDK, LangChain, vLLM extras, ...) send fields not modelled here. They are
    # kept (`model_extra`) rather than dropped: an upstream gets them forwarded untouched, and the
    # built-in engine refuses the known ones it cannot honour (`ctxgate.backend.openai_api.fields`).
    model_config = ConfigDict(extra="allow")


class ContentPart(_Lenient):
    type: str = "text"
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string; parts that are not text (images, audio) are refused with a 400."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text":
                raise APIError(
                    400,
                    f"content part of type '{part.type}' is not supported (text only)",
                    param="messages",
                    code="unsupported_content",
                )
            texts.append(part.text or "")
        # Separate parts stay separate paragraphs (as OpenAI's own rendering does); "" would glue
        # the last word of one part to the first of the next.
        return "\n".join(texts)


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(_Lenient):
    """What both endpoints share: the model, sampling and streaming options."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1, description="0 or -1 (vLLM's convention) disables top-k")
    n: int = Field(default=1, ge=1, description="choices per request (the built-in engine makes one)")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(
        default=0, ge=0, description="vLLM's: no EOS or stop token id before this many tokens"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(
        default=None, description="requests with different salts share no cached KV blocks"
    )
    priority: int = Field(default=0, description="vLLM convention: above 0 is background work")
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _minus_one_disables(cls, value: int) -> int:
        return 0 if value == -1 else value

    @field_validator("stop")
    @classmethod
    def _few_stop_sequences(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        return value

    def stop_list(self) -> list[str]:
        """The stop sequences as a list, empty strings dropped (they would stop at once)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [stop for stop in stops if stop]

    def usage_wanted(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None

    def requested_max_tokens(self) -> int | None:
        # `max_completion_tokens` replaced `max_tokens` in the OpenAI API; honour either.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(
        cls, value: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and not isinstance(value[0], int) and len(value) != 1:
            raise ValueError("exactly one prompt per request")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_text(self) -> str | None:
        """The prompt when it is text; None when it is token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) == 1 and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return None

    def prompt_token_ids(self) -> list[int] | None:
        """The prompt when it is token ids; None when it is text."""
        if isinstance(self.prompt, str):
            return None
        first = self.prompt[0]
        if isinstance(first, int):
            return [int(token_id) for token_id in self.prompt]  # type: ignore[arg-type]
        return list(first) if isinstance(first, list) else None
