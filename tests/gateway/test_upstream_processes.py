"""`ctxgate serve --upstream URL --upstream-api-key K --tokenizer DIR` in front of a real
`ctxgate engine serve --api-key K`: two real processes, real HTTP, the real OpenAI client."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from ctxgate.gateway.tokenizer_spec import TiktokenTokenizer, load_counting_tokenizer
from tests.support.servers import ctxgate_env, ctxgate_process, free_port, wait_http

KEY = "engine-secret"


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("procs")
    empty_cache = tmp / "cache"  # the default model is not here: the gateway must not need it
    env = ctxgate_env(CTXGATE_UPSTREAM_API_KEY="")
    engine_port, gateway_port = free_port(), free_port()
    engine_args = [
        "engine",
        "serve",
        "--port",
        str(engine_port),
        "--api-key",
        KEY,
        "--model",
        str(model_dir),
        "--kv-cache-memory-mb",
        "64",
        "--max-model-len",
        "2048",
        "--served-model-name",
        "smol",
    ]
    gateway_args = [
        "serve",
        "--port",
        str(gateway_port),
        "--upstream",
        f"http://127.0.0.1:{engine_port}/v1",
        "--upstream-api-key",
        KEY,
        "--tokenizer",
        str(model_dir),
        "--default-policy",
        "passthrough",
        "--served-model-name",
        "front",
    ]
    with ctxgate_process(engine_args, tmp / "engine.log", env):
        wait_http(f"http://127.0.0.1:{engine_port}/health", timeout_s=180)
        with ctxgate_process(
            gateway_args, tmp / "gateway.log", env | {"CTXGATE_CACHE_DIR": str(empty_cache)}
        ):
            wait_http(f"http://127.0.0.1:{gateway_port}/ready", timeout_s=180)
            yield f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}", empty_cache


def test_engine_server_needs_its_api_key(servers):
    engine_url, _, _ = servers
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    missing = httpx.post(f"{engine_url}/v1/chat/completions", json=body, timeout=30)
    wrong = httpx.post(
        f"{engine_url}/v1/chat/completions", json=body, timeout=30, headers={"Authorization": "Bearer nope"}
    )
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{engine_url}/health", timeout=10).status_code == 200  # probes stay open
    right = httpx.post(
        f"{engine_url}/v1/chat/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert right.status_code == 200, right.text


def test_gateway_reaches_keyed_engine_with_remote_tokenizer(servers):
    _, gateway_url, empty_cache = servers
    client = OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    response = client.chat.completions.create(
        model="front",
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=3,
        temperature=0,
        extra_body={"top_k": -1},
    )
    assert response.choices[0].message.content
    assert response.usage.model_extra["ctxgate"]["prompt_tokens"] == response.usage.prompt_tokens
    assert not (empty_cache / "models").exists()  # the default model package was never needed


def test_engine_refusal_reaches_the_client_naming_the_field(servers):
    _, gateway_url, _ = servers
    response = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        timeout=60,
        json={
            "model": "front",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "prediction": {"type": "content", "content": "hi"},
        },
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("prediction", "unsupported_parameter")


def test_tiktoken_counting_tokenizer():
    tokenizer = load_counting_tokenizer("cl100k_base")
    assert isinstance(tokenizer, TiktokenTokenizer)
    messages = [{"role": "user", "content": "How tall is Everest?"}]
    prompt = tokenizer.render_chat(messages)
    assert (
        tokenizer.count_chat(messages)
        == len(tokenizer.encode(prompt))
        > tokenizer.count("How tall is Everest?")
    )
    with pytest.raises(ValueError, match="neither a local tokenizer directory nor a tiktoken encoding"):
        load_counting_tokenizer("no-such-encoding")


def test_tiktoken_counts_tools_and_tool_calls():
    tokenizer = load_counting_tokenizer("cl100k_base")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    plain = len(tokenizer.encode(tokenizer.render_chat(messages)))
    with_tools = tokenizer.render_chat(messages, tools=tools)
    assert "get_weather" in with_tools and len(tokenizer.encode(with_tools)) > plain
    called = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        }
    ]
    assert "get_weather" in tokenizer.render_chat(called)
