"""The OpenAI protocol rules both servers share (`ctxgate.backend.openai_api`), pinned without an engine."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from ctxgate.backend.openai_api.errors import (
    ERROR_TYPES,
    APIError,
    ClientDisconnected,
    install_error_handlers,
)
from ctxgate.backend.openai_api.http import BodySizeLimit, parse_body, unless_disconnected
from ctxgate.backend.openai_api.responses import ResponseWriter, Usage
from ctxgate.backend.openai_api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from ctxgate.backend.openai_api.sse import DONE, read_sse_payloads, sse_event

ERROR_KEYS = {"message", "type", "param", "code"}


# -- errors --------------------------------------------------------------------------------------
def test_error_body_has_the_openai_shape():
    error = APIError(404, "no such model", param="model", code="model_not_found")
    assert error.body() == {
        "error": {
            "message": "no such model",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    response = APIError(429, "slow down", headers={"Retry-After": "3"}).response()
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    assert json.loads(response.body)["error"]["type"] == "rate_limit_error"


def test_every_413_has_one_type():
    # Prompt over budget and body over the size limit are the same kind of refusal to a client.
    assert APIError(413, "prompt too long", code="prompt_too_long").error_type == "invalid_request_error"
    assert ERROR_TYPES[413] == "invalid_request_error"


def test_unlisted_statuses_still_get_a_type():
    assert APIError(418, "teapot").error_type == "invalid_request_error"
    assert APIError(507, "full").error_type == "api_error"
    assert APIError(400, "x", error_type="custom").error_type == "custom"


def test_client_disconnect_is_499_aborted():
    error = ClientDisconnected()
    assert (error.status_code, error.error_type) == (499, "aborted")


# -- request parsing through a real app ----------------------------------------------------------
@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    async def chat(request: Request) -> dict:
        body = await parse_body(request, ChatCompletionRequest)
        return {"max_tokens": body.requested_max_tokens(), "text": body.messages[-1].text()}

    async def crash() -> dict:
        raise RuntimeError("bug")

    app.add_api_route("/chat", chat, methods=["POST"])
    app.add_api_route("/crash", crash, methods=["GET"])
    app.add_middleware(BodySizeLimit, max_body_bytes=512)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    return error


def _chat_body(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_valid_body_parses(client):
    response = client.post("/chat", json=_chat_body(max_tokens=5, max_completion_tokens=7))
    assert response.json() == {"max_tokens": 7, "text": "hi"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"stream": {"a": 1}}, "stream"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_invalid_field_is_400_naming_the_field(client, fields, param):
    error = _error(client.post("/chat", json=_chat_body(**fields)), 400)
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ")
    assert error["code"] == "invalid_value"


def test_several_problems_are_counted_in_one_line(client):
    error = _error(client.post("/chat", json=_chat_body(max_tokens=0, top_p=0, n=0)), 400)
    assert "(and 2 more problems)" in error["message"]


def test_the_surrogate_check_reads_a_large_body_once_and_keeps_what_is_valid():
    """Only a surrogate escape sends a body to the full check; escapes of other characters and
    surrogate pairs are kept, on a 100k-escape body."""
    from ctxgate.backend.openai_api.http import parse_json_object

    text = "\\u00e9" * 100_000 + "\\ud83d\\ude00"
    data = parse_json_object(('{"content": "' + text + '"}').encode())
    assert data["content"] == "\u00e9" * 100_000 + "\U0001f600"


@pytest.mark.parametrize(
    ("content", "mentions"),
    [
        (b"", "empty"),
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"model": "m", "messages": [], "temperature": NaN}', "NaN"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x\\uDFFFy"}]}', "surrogate"),
        # Not UTF-8: json decodes it with surrogatepass, so only the full check can tell.
        (
            '{"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}'.encode(
                "utf-16", "surrogatepass"
            ),
            "surrogate",
        ),
        (b"[" * 100_000, "nested"),
    ],
)
def test_malformed_json_is_400(content, mentions):
    app = FastAPI()
    install_error_handlers(app)

    async def chat(request: Request) -> dict:
        await parse_body(request, ChatCompletionRequest)
        return {}

    app.add_api_route("/chat", chat, methods=["POST"])
    with TestClient(app) as unlimited:
        error = _error(
            unlimited.post("/chat", content=content, headers={"content-type": "application/json"}), 400
        )
    assert mentions in error["message"]
    assert error["code"] == "invalid_json"


def test_wrong_content_type_is_415(client):
    error = _error(client.post("/chat", content=b"{}", headers={"content-type": "text/plain"}), 415)
    assert "application/json" in error["message"]


def test_non_text_content_part_is_400_on_messages(client):
    body = _chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    error = _error(client.post("/chat", json=body), 400)
    assert (error["param"], error["code"]) == ("messages", "unsupported_content")
    assert "image_url" in error["message"]


def test_routing_errors_and_bugs_keep_the_shape(client):
    assert _error(client.get("/nowhere"), 404)["type"] == "not_found_error"
    assert _error(client.get("/chat"), 405)["type"] == "invalid_request_error"
    crash = _error(client.get("/crash"), 500)
    assert crash["message"] == "internal error"  # no exception name or text: those stay in the log
    assert crash["code"] == "internal_error"


def test_body_over_the_limit_is_413_by_header_and_by_counting(client):
    declared = _error(client.post("/chat", json=_chat_body(user="x" * 1000)), 413)
    assert (declared["code"], declared["type"]) == ("body_too_large", "invalid_request_error")

    def chunks():  # no content-length: counted while reading
        for _ in range(10):
            yield b"x" * 100

    counted = _error(
        client.post("/chat", content=chunks(), headers={"content-type": "application/json"}), 413
    )
    assert counted["code"] == "body_too_large"


# -- request models ------------------------------------------------------------------------------
def test_completion_prompt_forms():
    assert CompletionRequest(prompt="hi").prompt_text() == "hi"
    assert CompletionRequest(prompt=["hi"]).prompt_text() == "hi"
    assert CompletionRequest(prompt=[1, 2, 3]).prompt_token_ids() == [1, 2, 3]
    assert CompletionRequest(prompt=[[4, 5]]).prompt_token_ids() == [4, 5]
    assert CompletionRequest(prompt=[1, 2]).prompt_text() is None
    with pytest.raises(ValueError, match="exactly one prompt"):
        CompletionRequest(prompt=["a", "b"])
    with pytest.raises(ValueError, match="must not be empty"):
        CompletionRequest(prompt=[])


def test_stop_list_and_usage_wanted():
    body = ChatCompletionRequest.model_validate(
        _chat_body(stop="END", stream_options={"include_usage": True})
    )
    assert body.stop_list() == ["END"] and body.usage_wanted()
    body = ChatCompletionRequest.model_validate(_chat_body(stop=["", "a"]))
    assert body.stop_list() == ["a"] and not body.usage_wanted()


def test_message_text_joins_text_parts():
    message = ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert message.text() == "a\nb"  # parts stay separate paragraphs, as OpenAI renders them
    assert ChatMessage(role="assistant", content=None).text() == ""


# -- SSE and response bodies ---------------------------------------------------------------------
def test_sse_framing():
    assert sse_event({"a": 1, "b": [1, 2]}) == 'data: {"a":1,"b":[1,2]}\n\n'
    assert DONE == "data: [DONE]\n\n"


async def _lines(text: str):
    for line in text.splitlines():
        yield line


async def _payloads(text: str) -> list[dict]:
    return [payload async for payload in read_sse_payloads(_lines(text))]


async def test_reading_stops_at_done_and_skips_noise():
    stream = ": keep-alive\n" + sse_event({"n": 1}) + "data: {broken\n\n" + sse_event({"n": 2}) + DONE
    stream += sse_event({"n": 3})
    assert await _payloads(stream) == [{"n": 1}, {"n": 2}]


async def test_chat_stream_events():
    writer = ResponseWriter("chatcmpl-1", "m", 7, chat=True)
    events = writer.opening() + [
        writer.text("Hel"),
        writer.text("lo"),
        writer.finish("stop"),
        writer.usage(Usage.of(3, 2, cached_tokens=1)),
    ]
    assert all(event.startswith("data: ") and event.endswith("\n\n") for event in events)
    chunks = await _payloads("".join(events) + DONE)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {(c["id"], c["model"], c["created"]) for c in chunks} == {("chatcmpl-1", "m", 7)}
    assert [c["choices"][0]["delta"] for c in chunks[:4]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "stop"]
    assert all("usage" not in c for c in chunks[:4])
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


async def test_completion_stream_events():
    writer = ResponseWriter("cmpl-1", "m", 7, chat=False)
    assert writer.opening() == []
    chunks = await _payloads(writer.text("x") + writer.finish("length"))
    assert [(c["object"], c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ("text_completion", "x", None),
        ("text_completion", "", "length"),
    ]


def test_whole_bodies():
    usage = Usage.of(2, 1, ctxgate={"policy": "p"})
    chat = ResponseWriter("chatcmpl-1", "m", 7, chat=True).whole("hi", "stop", usage)
    assert chat["object"] == "chat.completion"
    assert chat["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert chat["usage"]["ctxgate"] == {"policy": "p"} and chat["usage"]["total_tokens"] == 3
    text = ResponseWriter("cmpl-1", "m", 7, chat=False).whole("hi", "length", usage)
    assert text["object"] == "text_completion"
    assert text["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}]


# -- disconnects ---------------------------------------------------------------------------------
def _request(disconnect: asyncio.Event) -> Request:
    async def receive() -> dict:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


async def test_work_that_finishes_returns_its_result():
    async def work() -> str:
        return "done"

    assert await unless_disconnected(_request(asyncio.Event()), work()) == "done"


async def test_work_errors_propagate():
    async def work() -> str:
        raise TimeoutError("slow")

    with pytest.raises(TimeoutError, match="slow"):
        await unless_disconnected(_request(asyncio.Event()), work())


async def test_disconnect_cancels_the_work_and_runs_its_cleanup():
    disconnect = asyncio.Event()
    cleaned_up = []

    async def work() -> str:
        try:
            disconnect.set()  # the client leaves while the work is running
            await asyncio.sleep(60)
            return "too late"
        finally:
            cleaned_up.append(True)  # where the servers abort the generation

    with pytest.raises(ClientDisconnected):
        await asyncio.wait_for(unless_disconnected(_request(disconnect), work()), 5)
    assert cleaned_up == [True]
