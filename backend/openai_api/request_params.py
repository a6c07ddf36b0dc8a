"""From an OpenAI request body to what the built-in engine runs: the sampling extras (n, penalties,
logit bias, min-p, log probabilities), the grammar the output must follow (`response_format`, vLLM's
`guided_*`, a forced tool call) and how the answer is written back (`OutputOptions`).

Shared by the engine's own server and the gateway's built-in mode, so both read a field the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ctxgate.backend.engine.api import MAX_N, MAX_TOP_LOGPROBS
from ctxgate.backend.engine.guided import ANONYMOUS_TENANT, Guide, GuideError, GuideSpec, compiler_for
from ctxgate.backend.model.tokenizer import Tokenizer
from ctxgate.backend.openai_api.errors import APIError
from ctxgate.backend.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from ctxgate.backend.openai_api.tools import ToolUse, tool_use

Body = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class OutputOptions:
    """How choices are written: log probabilities (and the tokenizer that spells their tokens), tools."""

    tokenizer: Tokenizer | None = None
    logprobs: bool = False
    tools: ToolUse | None = None


def extra(body: Body, name: str) -> Any:
    """A field of `body`, modelled or not (vLLM's extras arrive as `model_extra`)."""
    if name in type(body).model_fields:
        return getattr(body, name)
    return (body.model_extra or {}).get(name)


def sampling_extras(body: Body) -> dict[str, Any]:
    """SamplingParams fields beyond the basic ones; an APIError names a malformed one."""
    fields: dict[str, Any] = {"n": body.n}
    if body.n > MAX_N:
        raise APIError(400, f"n must be at most {MAX_N}", param="n", code="invalid_value")
    for name, neutral in (
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),
        ("min_p", 0.0),
    ):
        value = extra(body, name)
        if value is None:
            value = neutral
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise APIError(400, f"{name} must be a number", param=name, code="invalid_value")
        fields[name] = float(value)
    fields["logit_bias"] = _logit_bias(extra(body, "logit_bias"))
    fields["logprobs"] = _logprobs(body)
    return fields


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    try:
        bias = {int(token): float(amount) for token, amount in dict(value).items()}
    except (TypeError, ValueError):
        raise APIError(
            400, "logit_bias must map token ids to numbers", param="logit_bias", code="invalid_value"
        ) from None
    return bias


def _logprobs(body: Body) -> int | None:
    if isinstance(body, CompletionRequest):
        count = body.logprobs  # completions: how many alternatives, 0 for the sampled token only
        name = "logprobs"
    else:
        top = extra(body, "top_logprobs")
        if top is not None and not body.logprobs:
            raise APIError(
                400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
            )
        count = (top or 0) if body.logprobs else None
        name = "top_logprobs"
    if count is not None and (
        isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_TOP_LOGPROBS
    ):
        raise APIError(
            400,
            f"{name} must be an integer between 0 and {MAX_TOP_LOGPROBS}",
            param=name,
            code="invalid_value",
        )
    return count


def tools_of(body: Body) -> ToolUse | None:
    if not isinstance(body, ChatCompletionRequest):
        return None
    return tool_use(extra(body, "tools"), extra(body, "tool_choice"))


def guide_spec(body: Body, tools: ToolUse | None) -> GuideSpec | None:
    """The one grammar the request asks for, or None; a 400 when it asks for two."""
    specs = [
        spec
        for spec in (
            _response_format(extra(body, "response_format")),
            *_guided_extras(body),
            _checked(tools.guide) if tools else None,
        )
        if spec is not None
    ]
    if len(specs) > 1:
        raise APIError(
            400,
            f"{specs[0].param} and {specs[1].param} both constrain the output; send one",
            param=specs[1].param,
            code="invalid_value",
        )
    return specs[0] if specs else None


def _response_format(value: Any) -> GuideSpec | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GuideSpec("json_object", "", "response_format")
    if kind == "json_schema":
        wrapper = value.get("json_schema")
        schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
        return _checked(lambda: GuideSpec.json_schema(schema or {"type": "object"}, "response_format"))
    raise APIError(
        400,
        "response_format.type must be text, json_object or json_schema",
        param="response_format",
        code="invalid_value",
    )


def _guided_extras(body: Body) -> list[GuideSpec | None]:
    found: list[GuideSpec | None] = []
    structured = extra(body, "structured_outputs")  # vLLM's newer spelling of the same four
    if structured is not None and not isinstance(structured, dict):
        raise APIError(
            400, "structured_outputs must be an object", param="structured_outputs", code="invalid_value"
        )
    for kind, name in (
        ("json", "guided_json"),
        ("regex", "guided_regex"),
        ("choice", "guided_choice"),
        ("grammar", "guided_grammar"),
    ):
        for param, value in (
            (name, extra(body, name)),
            (f"structured_outputs.{kind}", (structured or {}).get(kind)),
        ):
            if value is not None:
                found.append(
                    _checked(lambda kind=kind, value=value, param=param: _guided(kind, value, param))
                )
    return found


def _guided(kind: str, value: Any, param: str) -> GuideSpec:
    if kind == "json":
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError:
                raise GuideError(f"{param} must be a JSON schema", param) from None
        return GuideSpec.json_schema(value, param)
    if kind == "choice":
        return GuideSpec.choice(value, param)
    if not isinstance(value, str) or not value:
        raise GuideError(f"{param} must be a non-empty string", param)
    return GuideSpec("regex" if kind == "regex" else "grammar", value, param)


def _checked(build: Any) -> GuideSpec | None:
    try:
        spec = build()
        if spec is not None:
            spec.check_size()
        return spec
    except GuideError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None


_GUIDE_ERROR_CODES = {429: "rate_limit_exceeded", 503: "server_busy"}


async def compile_guide(
    spec: GuideSpec | None, tokenizer: Tokenizer, tenant: str = ANONYMOUS_TENANT
) -> Guide | None:
    """The compiled grammar (cached; compiled in a worker process, `tenant`'s compiles one at a
    time and in turn with other tenants'), or a 4xx/503 naming the problem."""
    if spec is None:
        return None
    try:
        return await compiler_for(tokenizer).compile(spec, tenant)
    except GuideError as exc:
        raise APIError(
            exc.status, str(exc), param=exc.param, code=_GUIDE_ERROR_CODES.get(exc.status, "invalid_value")
        ) from None


@dataclass(frozen=True)
class EngineAsks:
    """Everything a request asks of the built-in engine beyond the basic sampling fields."""

    sampling: dict[str, Any]  # SamplingParams keyword arguments, the guide among them
    output: OutputOptions


async def engine_asks(body: Body, tokenizer: Tokenizer, tenant: str = ANONYMOUS_TENANT) -> EngineAsks:
    """`tenant`: whose turn a grammar compile takes (the gateway's tenant; the engine server's key)."""
    tools = tools_of(body)
    sampling = sampling_extras(body)
    sampling["guide"] = await compile_guide(guide_spec(body, tools), tokenizer, tenant)
    output = OutputOptions(tokenizer=tokenizer, logprobs=sampling["logprobs"] is not None, tools=tools)
    return EngineAsks(sampling, output)
