"""Response bodies and stream chunks of the two generation endpoints, and the `usage` payload."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ctxgate.backend.engine.api import GenerationDelta, TokenLogprob
from ctxgate.backend.engine.deltas import ChoiceTotals, DeltaTotals
from ctxgate.backend.openai_api.logprobs import chat_logprobs, completion_logprobs
from ctxgate.backend.openai_api.request_params import OutputOptions
from ctxgate.backend.openai_api.sse import sse_event


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    # The gateway adds its own accounting block (`usage.ctxgate`) next to the OpenAI fields.
    model_config = ConfigDict(extra="allow")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, **extra: Any) -> Usage:
        """Usage with the total filled in; `extra` adds server-specific blocks (the gateway's `ctxgate`)."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            **extra,
        )


class AssistantMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, only when there are some

    role: Literal["assistant"] = "assistant"
    content: str | None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class ChatChunkChoice(BaseModel):
    index: int = 0
    # {"role", "content"} first, then {"content"} (or {"tool_calls"}), then {} with the finish reason
    delta: dict[str, Any]
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class _Envelope(BaseModel):
    id: str
    object: str
    created: int
    model: str


class ChatCompletion(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class TextCompletion(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class StreamChunk(_Envelope):
    """One streamed event; `usage` only on the last one, and only when the client asked for it."""

    choices: list[ChatChunkChoice] | list[CompletionChoice]
    usage: Usage | None = None

    def sse(self) -> str:
        return sse_event(self.model_dump(exclude={"usage"} if self.usage is None else None))


@dataclass(frozen=True)
class ResponseWriter:
    """Writes one request's answer (whole or streamed) for chat or plain completions."""

    response_id: str
    model: str
    created: int
    chat: bool
    output: OutputOptions = field(default_factory=OutputOptions)

    def whole(self, text: str, finish_reason: str | None, usage: Usage) -> dict[str, Any]:
        """The body of a non-streamed answer with one plain choice."""
        return self.whole_choices([ChoiceTotals(0, finish_reason, [], [text])], usage)

    def whole_choices(self, choices: list[ChoiceTotals], usage: Usage) -> dict[str, Any]:
        """The body of a non-streamed answer (its choices' text, log probabilities and tool calls)."""
        common = {"id": self.response_id, "model": self.model, "created": self.created, "usage": usage}
        if self.chat:
            return ChatCompletion(choices=[self._chat_choice(c) for c in choices], **common).model_dump(
                exclude_none=False
            )
        return TextCompletion(
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.text,
                    logprobs=self._logprobs(c.logprobs),
                    finish_reason=c.finish_reason or "stop",
                )
                for c in choices
            ],
            **common,
        ).model_dump()

    def _chat_choice(self, choice: ChoiceTotals) -> ChatChoice:
        content, calls = self._read_tools(choice.text)
        message = AssistantMessage(content=content, **({"tool_calls": calls} if calls else {}))
        finish = "tool_calls" if calls else choice.finish_reason or "stop"
        return ChatChoice(
            index=choice.index,
            message=message,
            logprobs=self._logprobs(choice.logprobs),
            finish_reason=finish,
        )

    def _read_tools(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        tools = self.output.tools
        return tools.read_calls(text) if tools else (text, [])

    def _logprobs(self, entries: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any] | None:
        tokenizer = self.output.tokenizer
        if not self.output.logprobs or tokenizer is None:
            return None
        if self.chat:
            return chat_logprobs(tokenizer, entries)
        return completion_logprobs(tokenizer, entries, text_offset)

    def opening(self, num_choices: int = 1) -> list[str]:
        """Events before the first text: chat streams announce the assistant role, per choice."""
        if not self.chat:
            return []
        return [
            self._chunk([ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
            for i in range(num_choices)
        ]

    def text(self, text: str) -> str:
        if self.chat:
            return self._chunk([ChatChunkChoice(delta={"content": text})])
        return self._chunk([CompletionChoice(text=text)])

    def delta_events(self, delta: GenerationDelta, totals: DeltaTotals) -> list[str]:
        """The events for one engine delta (already added to `totals`): its text (held back while a
        tool call may be forming), and when it ends its choice, the tool calls and the finish."""
        choice = totals.choice(delta.index)
        events = []
        if (delta.text or delta.logprobs) and self.output.tools is None:
            offset = len(choice.text) - len(delta.text)
            logprobs = self._logprobs(delta.logprobs or [], offset)
            if self.chat:
                events.append(
                    self._chunk(
                        [ChatChunkChoice(index=delta.index, delta={"content": delta.text}, logprobs=logprobs)]
                    )
                )
            else:
                events.append(
                    self._chunk([CompletionChoice(index=delta.index, text=delta.text, logprobs=logprobs)])
                )
        if delta.choice_finish_reason is not None or delta.finish_reason is not None:
            events.extend(self.choice_end(choice))
        return events

    def choice_end(self, choice: ChoiceTotals) -> list[str]:
        """A choice's closing events: what tool use held back (calls, or the text), then the finish."""
        reason = choice.finish_reason or "stop"
        if not self.chat:
            return [self._chunk([CompletionChoice(index=choice.index, text="", finish_reason=reason)])]
        events = []
        if self.output.tools is not None:
            content, calls = self._read_tools(choice.text)
            if calls:
                reason = "tool_calls"
                pieces = [{"index": i, **call} for i, call in enumerate(calls)]
                events.append(
                    self._chunk([ChatChunkChoice(index=choice.index, delta={"tool_calls": pieces})])
                )
            if content:
                events.append(
                    self._chunk(
                        [
                            ChatChunkChoice(
                                index=choice.index,
                                delta={"content": content},
                                logprobs=self._logprobs(choice.logprobs),
                            )
                        ]
                    )
                )
        events.append(self._chunk([ChatChunkChoice(index=choice.index, delta={}, finish_reason=reason)]))
        return events

    def finish(self, finish_reason: str | None) -> str:
        if self.chat:
            return self._chunk([ChatChunkChoice(delta={}, finish_reason=finish_reason)])
        return self._chunk([CompletionChoice(text="", finish_reason=finish_reason)])

    def usage(self, usage: Usage) -> str:
        return self._chunk([], usage=usage)

    def _chunk(
        self, choices: list[ChatChunkChoice] | list[CompletionChoice], usage: Usage | None = None
    ) -> str:
        chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        return StreamChunk(
            id=self.response_id,
            object=chunk_object,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        ).sse()


# -- relaying another server's stream ------------------------------------------------------------
def fold_chunks(chunks: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """The non-streamed response a stream's chunks add up to (OpenAI semantics: string deltas
    concatenate, tool calls merge by their index, log-probability lists extend). Fields the chunks
    carry that are not known here (`system_fingerprint`, vLLM's `stop_reason`, ...) are kept."""
    whole: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for key, value in chunk.items():
            if key not in ("choices", "usage", "object"):
                whole.setdefault(key, value)
        for choice in chunk.get("choices") or []:
            index = int(choice.get("index", 0))
            folded = choices.setdefault(index, _empty_choice(index, chat))
            for key, value in choice.items():
                if key == "delta" and chat:
                    _merge_message(folded["message"], value or {})
                elif key == "text" and not chat:
                    folded["text"] += value or ""
                elif key == "logprobs" and value is not None:
                    folded["logprobs"] = _merge_logprobs(folded.get("logprobs"), value)
                elif key not in ("index", "delta", "text", "logprobs") and value is not None:
                    folded[key] = value
    whole["object"] = "chat.completion" if chat else "text_completion"
    whole["choices"] = [_finish_choice(choices[index], chat) for index in sorted(choices)]
    return whole


def _empty_choice(index: int, chat: bool) -> dict[str, Any]:
    base: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None}
    return base | ({"message": {}} if chat else {"text": ""})


def _merge_message(message: dict[str, Any], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        if key == "tool_calls":
            calls = message.setdefault("tool_calls", {})
            for position, call in enumerate(value or []):
                _merge_tool_call(calls.setdefault(int(call.get("index", position)), {}), call)
        elif isinstance(value, str) and isinstance(message.get(key), str) and key != "role":
            message[key] += value
        elif value is not None or key not in message:
            message[key] = value


def _merge_tool_call(call: dict[str, Any], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        if key == "index":
            continue
        if key == "function" and isinstance(value, dict):
            function = call.setdefault("function", {})
            for name, part in value.items():  # the name comes once, the arguments in pieces
                function[name] = function.get(name, "") + part if isinstance(part, str) else part
        elif value is not None and key not in call:
            call[key] = value  # id and type come once, with the first piece


def _merge_logprobs(folded: dict[str, Any] | None, delta: dict[str, Any]) -> dict[str, Any]:
    merged = dict(folded or {})
    for key, value in delta.items():
        if isinstance(value, list) and isinstance(merged.get(key), list):
            merged[key] = merged[key] + value
        elif value is not None or key not in merged:
            merged[key] = value
    return merged


def _finish_choice(choice: dict[str, Any], chat: bool) -> dict[str, Any]:
    if chat:
        message = choice["message"]
        message.setdefault("role", "assistant")
        message.setdefault("content", None)
        if isinstance(message.get("tool_calls"), dict):
            message["tool_calls"] = [message["tool_calls"][i] for i in sorted(message["tool_calls"])]
    return choice
