"""Which request fields the built-in engine can honour, and what happens to the others.

The convention is LiteLLM's: a field the engine cannot honour is a 400 naming it (code
`unsupported_parameter`), unless the caller opted into `drop_params`, in which case it is dropped
and the dropped names are reported. A field is never accepted and then silently ignored. A field
sent with its neutral value (`n: 1`, `presence_penalty: 0`, `response_format: {"type": "text"}`, ...)
asks for nothing the engine does not do, so it is accepted.

An upstream server gets every field forwarded instead (`ctxgate.backend.routing.upstream`), and decides itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ctxgate.backend.openai_api.errors import APIError
from ctxgate.backend.openai_api.schemas import ChatCompletionRequest, CompletionRequest

Neutral = Callable[[Any], bool]


def _none(value: Any) -> bool:
    return value is None


def _falsy(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {}


def _one(value: Any) -> bool:
    return value is None or value == 1


def _no_forced_tool(value: Any) -> bool:
    # "none" (and "auto" with no tools, checked with `tools`) is what the engine does anyway.
    return value is None or value in ("none", "auto")


def _text_modality(value: Any) -> bool:
    return value is None or value == ["text"]


@dataclass(frozen=True)
class Capability:
    """A field the engine does not implement, the values that ask nothing of it, and why."""

    name: str
    neutral: Neutral
    why: str


# Fields of the OpenAI API (and vLLM's extras) that change the answer and that the built-in engine
# does not implement. What it does implement (sampling, penalties, logit_bias, min_p, n, logprobs,
# response_format, guided decoding, tools: backend/openai_api/request_params.py) and pure metadata
# (`user`, `metadata`, `store`, `service_tier`) are not listed.
_SHARED: tuple[Capability, ...] = (
    Capability("best_of", _one, "it makes no extra choices to pick the best of"),
)
_CHAT_ONLY: tuple[Capability, ...] = (
    Capability("functions", _falsy, "it takes the legacy functions field as tools only"),
    Capability(
        "function_call", _no_forced_tool, "it takes the legacy function_call field as tool_choice only"
    ),
    Capability("audio", _none, "it has no audio output"),
    Capability("modalities", _text_modality, "it answers in text only"),
    Capability("prediction", _none, "it has no predicted outputs"),
    Capability("reasoning_effort", _none, "it is not a reasoning model"),
    Capability("web_search_options", _none, "it cannot search the web"),
)
_COMPLETION_ONLY: tuple[Capability, ...] = (
    Capability("echo", _falsy, "it does not echo the prompt"),
    Capability("suffix", _none, "it has no insertion (suffix) mode"),
)
_MESSAGE_FIELDS: tuple[Capability, ...] = (
    Capability("function_call", _none, "it takes the legacy function_call field as tool_calls only"),
)


@dataclass(frozen=True)
class Unsupported:
    param: str  # as a client names it: "tools", "messages[2].tool_calls"
    why: str


def _value(body: Any, name: str) -> Any:
    if name in type(body).model_fields:
        return getattr(body, name)
    return (body.model_extra or {}).get(name)


def unsupported_fields(body: ChatCompletionRequest | CompletionRequest) -> list[Unsupported]:
    """Fields of `body` set to something the built-in engine cannot do, in a stable order."""
    chat = isinstance(body, ChatCompletionRequest)
    found = [
        Unsupported(cap.name, cap.why)
        for cap in _SHARED + (_CHAT_ONLY if chat else _COMPLETION_ONLY)
        if not cap.neutral(_value(body, cap.name))
    ]
    if chat:
        for index, message in enumerate(body.messages):
            found.extend(
                Unsupported(f"messages[{index}].{cap.name}", cap.why)
                for cap in _MESSAGE_FIELDS
                if not cap.neutral(_value(message, cap.name))
            )
    return found


def enforce_supported(
    body: ChatCompletionRequest | CompletionRequest, drop_params: bool, engine: str = "the built-in engine"
) -> list[str]:
    """The names of the unsupported fields dropped (with `drop_params`), or a 400 naming the first."""
    found = unsupported_fields(body)
    if found and not drop_params:
        first = found[0]
        others = f" (also unsupported: {', '.join(u.param for u in found[1:])})" if len(found) > 1 else ""
        raise APIError(
            400,
            f"{first.param} is not supported by {engine}: {first.why}{others}. Send it to an upstream "
            "that supports it, or set drop_params (policy field or --drop-params) to drop such fields.",
            param=first.param,
            code="unsupported_parameter",
        )
    return [u.param for u in found]
