"""OpenAI request fields x {built-in engine, upstream}: honoured, a 400 naming the field, or dropped only
under drop_params; never silently ignored. The upstream here is a small recording OpenAI-style server
(no vLLM on CI) that answers with tool calls and log probabilities, so relaying them is checked."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from openai import OpenAI

from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import ServerThread, write_policy

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Say hi."}]
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
]

# Fields the built-in engine cannot honour, with a value that asks for them.
UNSUPPORTED: list[tuple[str, Any]] = [
    ("best_of", 3),
    ("functions", [{"name": "lookup", "parameters": {"type": "object"}}]),
    ("reasoning_effort", "low"),
    ("prediction", {"type": "content", "content": "hi"}),
]
# Fields the built-in engine honours now (backend/openai_api/request_params.py), with a check of the answer.
ENGINE_FIELDS: list[tuple[dict[str, Any], Any]] = [
    ({"tools": TOOLS}, lambda body: body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")),
    (
        {"tools": TOOLS, "tool_choice": "required", "max_tokens": 30},
        lambda body: body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "lookup",
    ),
    (
        {"response_format": {"type": "json_object"}},
        lambda body: body["choices"][0]["message"]["content"][0] == "{",
    ),
    (
        {"logprobs": True, "top_logprobs": 2},
        lambda body: len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2,
    ),
    (
        {"presence_penalty": 0.5, "frequency_penalty": -0.3, "logit_bias": {"42": 5}, "min_p": 0.1},
        lambda body: body["usage"]["completion_tokens"] >= 1,
    ),
    ({"n": 2, "temperature": 1.0, "seed": 3}, lambda body: [c["index"] for c in body["choices"]] == [0, 1]),
    (
        {"guided_choice": ["yes", "no"]},
        lambda body: body["choices"][0]["message"]["content"] in ("yes", "no"),
    ),
]
# Fields it honours, or neutral values that ask nothing it does not do.
HONOURED: list[tuple[str, Any]] = [
    ("temperature", 0),
    ("top_p", 0.5),
    ("top_k", -1),  # vLLM's "disabled"
    ("seed", 7),
    ("stop", ""),  # an empty stop string is no stop string (it must not end the answer at once)
    ("stop", ["", "\n\n\n"]),
    ("n", 1),
    ("presence_penalty", 0),
    ("response_format", {"type": "text"}),
    ("tool_choice", "none"),
    ("logprobs", False),
    ("user", "someone"),
]


# -- the built-in engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def builtin(engine, tmp_path_factory):
    policy_dir = tmp_path_factory.mktemp("policies")
    write_policy(
        policy_dir,
        "drop",
        "name: drop\nmax_input_tokens: 1800\ndrop_params: true\ncompression_enabled: false\n",
    )
    settings = GatewaySettings(default_policy="passthrough", policy_dir=policy_dir)
    with ServerThread(create_app(settings, engine=engine)) as running:
        yield running


def _chat(url: str, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 3, "temperature": 0} | fields
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize(("field", "value"), UNSUPPORTED, ids=[f for f, _ in UNSUPPORTED])
def test_builtin_refuses_unsupported_field_naming_it(builtin, field, value):
    response = _chat(builtin.url, **{field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (field, "unsupported_parameter")
    assert field in error["message"] and "drop_params" in error["message"]


@pytest.mark.parametrize(("field", "value"), UNSUPPORTED[:2], ids=[f for f, _ in UNSUPPORTED[:2]])
def test_builtin_drops_unsupported_field_under_policy_drop_params(builtin, field, value):
    response = _chat(builtin.url, **{field: value}, ctxgate={"policy": "drop"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["ctxgate"]["dropped_params"] == [field]


@pytest.mark.parametrize(("fields", "check"), ENGINE_FIELDS, ids=[",".join(f) for f, _ in ENGINE_FIELDS])
def test_builtin_honours_engine_fields(builtin, fields, check):
    response = _chat(builtin.url, **fields)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["ctxgate"]["dropped_params"] == []
    assert check(body), body


def test_builtin_makes_and_counts_n_choices(builtin):
    body = _chat(builtin.url, n=3, temperature=1.0, seed=1, max_tokens=2, ignore_eos=True).json()
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 6  # every choice's tokens are billed


def test_builtin_reserves_every_choice(builtin):
    gateway = builtin.server.config.app.state.gateway
    assert gateway.fields.choices_for(gateway_body(n=4), None) == 4


def gateway_body(**fields: Any):
    from ctxgate.gateway.schemas import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": QUESTION} | fields)


def test_builtin_accepts_tool_calls_and_tool_results_in_history(builtin):
    messages = [
        {"role": "user", "content": "Look it up."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "user", "content": "So?"},
    ]
    response = _chat(builtin.url, messages=messages, tools=TOOLS)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("field", "value"), HONOURED, ids=[f"{f}={v!r}" for f, v in HONOURED])
def test_builtin_honours_supported_field(builtin, field, value):
    response = _chat(builtin.url, **{field: value})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["ctxgate"]["dropped_params"] == []
    assert body["usage"]["completion_tokens"] >= 1  # an empty stop did not end the answer at once
    assert body["choices"][0]["message"]["content"]


def test_builtin_server_flag_drop_params(engine):
    settings = GatewaySettings(default_policy="passthrough", drop_params=True)
    with ServerThread(create_app(settings, engine=engine)) as running:
        response = _chat(running.url, best_of=2, reasoning_effort="low")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["ctxgate"]["dropped_params"] == ["best_of", "reasoning_effort"]


def test_content_parts_are_joined_by_newlines(builtin):
    parts = [
        {"type": "text", "text": "Answer with one word."},
        {"type": "text", "text": "What colour is grass?"},
    ]
    response = httpx.post(
        f"{builtin.url}/v1/ctxgate/compress",
        timeout=60,
        json={"model": MODEL, "messages": [{"role": "user", "content": parts}]},
    )
    assert response.json()["messages"][-1]["content"] == "Answer with one word.\nWhat colour is grass?"


# -- upstream mode ---------------------------------------------------------------------------------
def _recording_upstream() -> tuple[FastAPI, list[dict[str, Any]]]:
    """An OpenAI-style server that records each body and answers with a tool call (when tools are
    offered) or text with log probabilities, split over several chunks as real servers stream."""
    received: list[dict[str, Any]] = []
    app = FastAPI()

    async def models() -> dict:
        return {"object": "list", "data": [{"id": "remote-model", "object": "model", "max_model_len": 4096}]}

    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        received.append(body)
        envelope = {
            "id": "chatcmpl-up",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "remote-model",
            "system_fingerprint": "fp-up",
        }
        if body.get("tools"):
            deltas = [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "lookup", "arguments": ""},
                        }
                    ],
                },
                {"tool_calls": [{"index": 0, "function": {"arguments": '{"q": '}}]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '"grass"}'}}]},
            ]
            pieces = [{"delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            finish = "tool_calls"
        else:
            pieces = [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}] + [
                {
                    "delta": {"content": word},
                    "finish_reason": None,
                    "logprobs": {
                        "content": [{"token": word, "logprob": -0.5, "bytes": None, "top_logprobs": []}]
                    },
                }
                for word in ("Hello", " there")
            ]
            finish = "stop"
        chunks = [envelope | {"choices": [{"index": 0} | piece]} for piece in pieces]
        chunks.append(envelope | {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        chunks.append(
            envelope
            | {
                "choices": [],
                "usage": {
                    "prompt_tokens": 11,
                    "completion_tokens": 3,
                    "total_tokens": 14,
                    "completion_tokens_details": {"reasoning_tokens": 0},
                },
            }
        )

        async def events():
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    return app, received


@pytest.fixture(scope="module")
def upstream_pair(model_dir):
    upstream_app, received = _recording_upstream()
    with ServerThread(upstream_app) as upstream:
        settings = GatewaySettings(
            upstreams=[upstream.url],
            served_model_name="front",
            default_policy="passthrough",
            tokenizer=str(model_dir),
        )
        with ServerThread(create_app(settings)) as front:
            front.received = received
            yield front


@pytest.mark.parametrize(
    ("field", "value"), UNSUPPORTED + HONOURED, ids=[f"{f}={v!r}" for f, v in UNSUPPORTED + HONOURED]
)
def test_upstream_gets_every_allowed_field_untouched(upstream_pair, field, value):
    response = httpx.post(
        f"{upstream_pair.url}/v1/chat/completions",
        timeout=60,
        json={
            "model": "front",
            "messages": QUESTION,
            "max_tokens": 3,
            field: value,
            "vendor_extra": {"a": [1]},
        },
    )
    assert response.status_code == 200, response.text
    sent = upstream_pair.received[-1]
    # Off the allow-list (gateway/forwarding.py): the legacy `functions`, which a template would render
    # uncounted, and unknown vendor fields; named in dropped_params.
    dropped = sorted({"vendor_extra"} | ({field} if field == "functions" else set()))
    assert response.json()["usage"]["ctxgate"]["dropped_params"] == dropped
    assert not set(dropped) & set(sent)
    if field == "functions":
        return
    if field == "stop":  # the one sampling field the gateway normalises: empty strings would stop at once
        expected = [stop for stop in ([value] if isinstance(value, str) else value) if stop]
        assert sent.get("stop") == (expected or None)
    else:
        assert sent[field] == value
    assert sent["model"] == "remote-model" and sent["max_tokens"] == 3


def test_upstream_tool_calls_and_logprobs_come_back_whole_and_streamed(upstream_pair):
    client = OpenAI(base_url=f"{upstream_pair.url}/v1", api_key="x", max_retries=0)
    called = client.chat.completions.create(model="front", messages=QUESTION, tools=TOOLS, max_tokens=8)
    call = called.choices[0].message.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("call_1", "lookup", '{"q": "grass"}')
    assert called.choices[0].finish_reason == "tool_calls"
    assert called.system_fingerprint == "fp-up" and called.model == "front"
    assert called.usage.completion_tokens_details.reasoning_tokens == 0  # the upstream's usage, kept
    assert called.usage.model_extra["ctxgate"]["policy"] == "passthrough"

    texted = client.chat.completions.create(model="front", messages=QUESTION, logprobs=True, max_tokens=8)
    assert texted.choices[0].message.content == "Hello there"
    assert [t.token for t in texted.choices[0].logprobs.content] == ["Hello", " there"]

    stream = client.chat.completions.create(
        model="front",
        messages=QUESTION,
        tools=TOOLS,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [
        c.choices[0].delta.tool_calls[0].function.arguments
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
    ]
    assert "".join(pieces) == '{"q": "grass"}'
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.prompt_tokens == 11 and "ctxgate" in chunks[-1].usage.model_extra
    assert {c.id for c in chunks} == {"chatcmpl-up"}  # one envelope: the upstream's


def test_upstream_forwards_tool_messages(upstream_pair):
    messages = [
        {"role": "user", "content": "Look it up."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    response = httpx.post(
        f"{upstream_pair.url}/v1/chat/completions",
        timeout=60,
        json={"model": "front", "messages": messages, "tools": TOOLS, "max_tokens": 3},
    )
    assert response.status_code == 200, response.text
    sent = upstream_pair.received[-1]["messages"]
    assert sent[1]["tool_calls"] == messages[1]["tool_calls"]
    assert sent[2]["tool_call_id"] == "c1"
