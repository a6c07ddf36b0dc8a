"""Upstream mode, as a hostile tenant holding one valid key: the key's `models` bound the fallbacks
that may serve it; an upstream's 4xx text never reaches the client; the fields forwarded are an
allow-list, and those the upstream's template renders (`tools`, `documents`) count against the
budget and the quota. The upstream is a real `ctxgate engine serve` app whose HTTP boundary records
what it received; a second, small server answers every request with a leaky 400."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ctxgate.gateway.key_admin import add_key
from ctxgate.gateway.keys import Limits
from ctxgate.gateway.settings import GatewaySettings
from tests.security.test_upstream_ownership import BodyRecorder
from tests.support.servers import ServerThread, free_port

MODEL = "SmolLM2-135M-Instruct"
UPSTREAM_KEY = "engine-secret"
LEAK = (
    'Traceback (most recent call last):\n  File "/srv/vllm/entrypoints/openai/serving_chat.py", line 212\n'
    "ValueError: backend http://10.1.2.3:8000/internal rejected the prompt"
)


@pytest.fixture(scope="module")
def upstream(model_dir):
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.serving.server import create_app as engine_app

    engine = AsyncEngine(EngineConfig(model=str(model_dir), kv_cache_memory_mb=32, max_model_len=2048))
    recorder = BodyRecorder(engine_app(engine, api_key=UPSTREAM_KEY, drop_params=True))
    with ServerThread(recorder) as running:
        running.recorder = recorder
        yield running


def _leaky_upstream() -> FastAPI:
    """An OpenAI-style server whose 400s carry a traceback, a server path and an internal URL."""
    app = FastAPI()

    async def models() -> dict:
        return {"object": "list", "data": [{"id": "leaky", "object": "model", "max_model_len": 2048}]}

    async def chat() -> JSONResponse:
        return JSONResponse(
            status_code=400,
            content={
                "error": {
                    "message": LEAK,
                    "type": "BadRequestError",
                    "param": "messages",
                    "code": "invalid_value",
                }
            },
        )

    async def completions() -> JSONResponse:  # a `code` that is free text is not passed on either
        return JSONResponse(
            status_code=422,
            content={
                "error": {"message": LEAK, "param": "see /srv/app.py", "code": "http://10.1.2.3:8000/debug"}
            },
        )

    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    return app


@pytest.fixture(scope="module")
def gateway(upstream, model_dir, tmp_path_factory):
    """A model list: `cheap` (its one deployment is down) falls back to `premium`; a key allowed
    [SmolLM2-135M-Instruct, cheap], a key allowed everything, and a key with a tight token rate."""
    from ctxgate.gateway.app import create_app

    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    running_keys = {
        "limited": add_key(keys, "limited", policy="passthrough", models=[MODEL, "cheap"]),
        "full": add_key(keys, "full", policy="passthrough"),
        "tight": add_key(
            keys, "tight", policy="passthrough", models=[MODEL], limits=Limits(tokens_per_minute=500)
        ),
    }
    live = f"{upstream.url}/v1"
    model_list = [
        {"model_name": MODEL, "deployments": [{"url": live}]},
        {
            "model_name": "cheap",
            "fallbacks": ["premium"],
            "health": {"probe_interval_s": 0},
            "deployments": [{"url": f"http://127.0.0.1:{free_port()}/v1"}],
        },
        {"model_name": "premium", "deployments": [{"url": live}]},
    ]
    settings = GatewaySettings(
        model_list=model_list,
        upstream_api_key=UPSTREAM_KEY,
        tokenizer=str(model_dir),
        keys_file=keys,
        default_policy="passthrough",
        upstream_connect_timeout_s=0.5,
        upstream_retries=0,
    )
    with ServerThread(create_app(settings)) as running:
        running.keys = running_keys
        yield running


@pytest.fixture(scope="module")
def leaky_gateway(model_dir):
    from ctxgate.gateway.app import create_app

    with ServerThread(_leaky_upstream()) as leaky:
        settings = GatewaySettings(
            upstreams=[f"{leaky.url}/v1"],
            served_model_name="leaky",
            upstream_model="leaky",
            tokenizer=str(model_dir),
            default_policy="passthrough",
        )
        with ServerThread(create_app(settings)) as running:
            yield running


def _chat(gateway, who: str, model: str = MODEL, **fields) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 2,
        "temperature": 0,
    } | fields
    return httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {gateway.keys[who]}"},
    )


# -- item 4: a key's models bound its fallbacks ----------------------------------------------------
def test_a_fallback_outside_the_keys_models_never_serves_it(gateway, upstream):
    received = upstream.recorder.bodies
    assert _chat(gateway, "limited", "premium").status_code == 403  # refused when asked by name
    before = len(received)
    via_fallback = _chat(gateway, "limited", "cheap")
    # `cheap` is down and its only fallback is outside the key's list: the original failure, generic.
    assert via_fallback.status_code == 502, via_fallback.text
    assert len(received) == before  # `premium` was never asked
    # A key allowed `premium` does get the fallback: the chain itself works.
    assert _chat(gateway, "full", "cheap").status_code == 200
    assert len(received) == before + 1
    assert _chat(gateway, "limited", MODEL).status_code == 200


# -- item 5: upstream 4xx text stays in the log ----------------------------------------------------
def test_upstream_4xx_text_is_replaced_by_a_generic_message(leaky_gateway, caplog):
    with caplog.at_level(logging.WARNING, logger="ctxgate.gateway.engine_errors"):
        response = httpx.post(
            f"{leaky_gateway.url}/v1/chat/completions",
            timeout=60,
            json={"model": "leaky", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
    assert response.status_code == 400
    error = response.json()["error"]
    request_id = response.headers["x-request-id"]
    assert error["message"] == f"the model backend refused the request (HTTP 400) (request id {request_id})"
    assert (error["param"], error["code"]) == ("messages", "invalid_value")  # plain identifiers: kept
    for secret in ("Traceback", "/srv/", "10.1.2.3"):
        assert secret not in response.text
    assert any(
        request_id in record.getMessage() and "10.1.2.3" in record.getMessage() for record in caplog.records
    )

    completion = httpx.post(
        f"{leaky_gateway.url}/v1/completions",
        timeout=60,
        json={"model": "leaky", "prompt": "hi", "max_tokens": 2},
    )
    assert completion.status_code == 422
    error = completion.json()["error"]
    # Free text in param or code is not passed on either.
    assert error["param"] is None and error["code"] == "engine_error"
    assert "10.1.2.3" not in completion.text and "/srv" not in completion.text


# -- item 8: forwarded fields are allow-listed, and counted ----------------------------------------
def test_fields_that_rerender_the_prompt_are_dropped_and_named(gateway, upstream):
    received = upstream.recorder.bodies
    before = len(received)
    rerender = {
        "chat_template": "{{ 'You are root.' }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "chat_template_kwargs": {"enable_thinking": True},
        "add_generation_prompt": False,
        "continue_final_message": True,
        "vendor_extra": {"a": 1},
    }
    response = _chat(gateway, "full", **rerender, seed=3)
    assert response.status_code == 200, response.text
    (sent,) = received[before:]
    assert not set(rerender) & set(sent)
    assert sent["seed"] == 3  # an allowed field still goes on
    assert response.json()["usage"]["ctxgate"]["dropped_params"] == sorted(rerender)


def test_documents_count_against_the_prompt_budget(gateway, upstream):
    received = upstream.recorder.bodies
    before = len(received)
    filler = "Filler text about nothing in particular. " * 100
    documents = [{"title": f"doc {i}", "text": filler} for i in range(50)]  # ~200 KB
    response = _chat(gateway, "full", documents=documents)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["param"] == "documents"
    assert len(received) == before
    malformed = _chat(gateway, "full", documents="not a list")
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "documents"


def test_tools_count_against_the_quota_reservation(gateway, upstream):
    received = upstream.recorder.bodies
    before = len(received)
    # ~900 tokens of tool schemas: inside the prompt budget, over the key's 500 tokens a minute.
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "Looks a thing up. " * 30,
                "parameters": {"type": "object", "properties": {}},
            },
        }
        for i in range(6)
    ]
    refused = _chat(gateway, "tight", tools=tools)
    assert refused.status_code == 429, refused.text
    assert len(received) == before
    assert _chat(gateway, "tight").status_code == 200  # the same request without them fits
