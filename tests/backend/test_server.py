"""The standalone OpenAI-compatible server, exercised through a real uvicorn server and the openai SDK."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.support.metrics import metric_value
from tests.support.servers import serve_engine
from tests.support.waiting import wait_until_engine_idle

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def engine(model_dir):
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig

    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        block_size=16,
        num_kv_blocks=96,
        max_num_batched_tokens=128,
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
    )
    return AsyncEngine(config)


@pytest.fixture(scope="module")
def base_url(engine):
    with serve_engine(engine) as url:
        yield url


@pytest.fixture()
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def _unique(text: str) -> str:
    # A fresh prefix per test keeps earlier tests' cached blocks from changing what a test measures.
    return f"[{uuid.uuid4().hex[:8]}] {text}"


async def test_engine_implements_the_client_interface(engine):
    from ctxgate.backend.engine.api import EngineClient

    assert isinstance(engine, EngineClient)
    assert engine.tokenizer is not None
    assert engine.metrics_registry is engine.metrics.registry
    assert dict(engine.groups) == {}  # one model: no model list to read limits from
    # In-process readiness is always current, so the gateway never needs to poll it.
    assert not engine.needs_health_check
    assert await engine.check_health() == engine.is_ready()


def test_models_health_and_metrics(base_url, client, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [engine.model_name]
    # The compute path that serves is on /v1/models and in the engine_path_info metric.
    from ctxgate.backend.platform.cpu_features import cpu_path

    engine_path = models.data[0].model_extra["engine_path"]
    assert engine_path["device"] == "cpu" and engine_path["cpu_flags"] == list(cpu_path().flags)
    assert f'cpu_kernel_isa="{engine_path["cpu_kernel_isa"]}"' in httpx.get(base_url + "/metrics").text
    health = httpx.get(base_url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = httpx.get(base_url + "/metrics").text
    for name in (
        "ctxgate:time_to_first_token_seconds",
        "ctxgate:inter_token_latency_seconds",
        "ctxgate:request_time_per_output_token_seconds",
        "ctxgate:e2e_request_latency_seconds",
        "ctxgate:request_queue_time_seconds",
        "ctxgate:request_prefill_time_seconds",
        "ctxgate:prompt_tokens_total",
        "ctxgate:generation_tokens_total",
        "ctxgate:num_requests_running",
        "ctxgate:num_requests_waiting",
        "ctxgate:kv_cache_usage_perc",
        "ctxgate:prefix_cache_queries_total",
        "ctxgate:prefix_cache_hits_total",
        "ctxgate:num_preemptions_total",
        "ctxgate:ttft_target_misses_total",
        "ctxgate:interleaved_prefills_total",
    ):
        # A sample line (not only the HELP text) exists from the start.
        assert f'{name}{{model_name="{engine.model_name}"}}' in metrics or f"{name}_count" in metrics, name


def test_chat_streamed_equals_non_streamed(client, engine):
    messages = [{"role": "user", "content": _unique("Name a colour.")}]
    full = client.chat.completions.create(
        model=engine.model_name, messages=messages, max_tokens=6, temperature=0
    )
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length")
    usage = full.usage
    assert usage.prompt_tokens == engine.tokenizer.count_chat(messages)
    assert 1 <= usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens is not None

    chunks = list(
        client.chat.completions.create(
            model=engine.model_name,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens


def test_completions_streamed_equals_non_streamed(client, engine):
    prompt = _unique("The capital of France is")
    full = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=5, temperature=0)
    assert full.object == "text_completion"
    assert full.usage.prompt_tokens == engine.tokenizer.count(prompt)
    assert full.usage.completion_tokens == 5 or full.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model=engine.model_name, prompt=prompt, max_tokens=5, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    # vLLM-style extras and token-id prompts are accepted.
    ids = engine.tokenizer.encode(prompt)
    by_ids = client.completions.create(
        model=engine.model_name,
        prompt=ids,
        max_tokens=5,
        temperature=0,
        extra_body={"top_k": 5, "seed": 1, "stop_token_ids": [], "priority": 0},
    )
    assert by_ids.choices[0].text == full.choices[0].text


def test_prefix_cache_hits_and_salt_isolation(base_url, client, engine):
    # > 3 blocks of 16 tokens shared, so at least two full blocks can be reused.
    prompt = _unique("Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. " * 6)
    assert engine.tokenizer.count(prompt) >= 64

    def complete(salt: str | None):
        extra = {"cache_salt": salt} if salt else {}
        return client.completions.create(
            model=engine.model_name, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra
        )

    hits_before = metric_value(httpx.get(base_url + "/metrics").text, "ctxgate:prefix_cache_hits_total")
    first = complete(None)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = complete(None)
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert second.choices[0].text == first.choices[0].text
    hits_after = metric_value(httpx.get(base_url + "/metrics").text, "ctxgate:prefix_cache_hits_total")
    assert hits_after - hits_before >= 32

    other_tenant = complete("tenant-b")
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0
    assert other_tenant.choices[0].text == first.choices[0].text


def test_client_disconnect_mid_stream_frees_blocks(base_url, client, engine):
    wait_until_engine_idle(engine)
    metrics_url = base_url + "/metrics"
    aborts_before = metric_value(
        httpx.get(metrics_url).text, "ctxgate:request_success_total", finished_reason="abort"
    )
    stream = client.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "user", "content": _unique("Tell a long story.")}],
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += 1
        if received >= 2:
            break
    stream.close()
    wait_until_engine_idle(engine)
    aborts_after = metric_value(
        httpx.get(metrics_url).text, "ctxgate:request_success_total", finished_reason="abort"
    )
    assert aborts_after == aborts_before + 1


def test_client_disconnect_non_streamed_frees_blocks(base_url, engine):
    wait_until_engine_idle(engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            base_url + "/v1/completions",
            json={
                "model": engine.model_name,
                "prompt": _unique("Once upon a time"),
                "max_tokens": 200,
                "ignore_eos": True,
            },
            timeout=httpx.Timeout(10, read=0.5),
        )
    wait_until_engine_idle(engine)


def _post(base_url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(base_url + path, timeout=60, **kwargs)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", -3, "max_tokens"),
        ("temperature", -0.5, "temperature"),
        ("top_p", 0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("max_tokens", "many", "max_tokens"),
        ("temperature", "hot", "temperature"),
        ("messages", "not a list", "messages"),
        ("stream", {"a": 1}, "stream"),
        ("min_tokens", -1, "min_tokens"),
        ("min_tokens", 10_000, "min_tokens"),
    ],
)
def test_bad_chat_input_is_400(base_url, engine, field, value, words):
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body[field] = value
    response = _post(base_url, "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_json_is_400(base_url, path):
    response = _post(
        base_url, path, content=b'{"model": "x", "prompt": ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]


def test_prompt_longer_than_context_is_400(base_url, client, engine):
    long_prompt = "word " * (MAX_MODEL_LEN + 50)
    response = _post(
        base_url, "/v1/completions", json={"model": engine.model_name, "prompt": long_prompt, "max_tokens": 4}
    )
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(
            model=engine.model_name, messages=[{"role": "user", "content": long_prompt}], max_tokens=4
        )
    # Fits alone, but not together with the requested output.
    response = _post(
        base_url,
        "/v1/completions",
        json={"model": engine.model_name, "prompt": "word " * 200, "max_tokens": 100},
    )
    assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]


def test_unknown_model_is_404(client, base_url):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    response = _post(
        base_url,
        "/v1/chat/completions",
        json={"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"echo": True}, "echo"),
    ],
)
def test_unsupported_fields_are_400_naming_them_or_dropped_with_the_flag(
    base_url, engine, path, fields, param
):
    from ctxgate.backend.serving.server import create_app
    from tests.support.servers import ServerThread

    body = (
        {"max_tokens": 1}
        | fields
        | ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "One, two,"})
    )
    refused = httpx.post(base_url + path, json=body, timeout=60)
    assert refused.status_code == 400
    assert (refused.json()["error"]["param"], refused.json()["error"]["code"]) == (
        param,
        "unsupported_parameter",
    )
    with ServerThread(create_app(engine, manage_engine=False, drop_params=True)) as dropping:
        assert httpx.post(dropping.url + path, json=body, timeout=60).status_code == 200


def test_api_key_guards_v1_but_not_health(engine):
    from ctxgate.backend.serving.server import create_app
    from tests.support.servers import ServerThread

    with ServerThread(create_app(engine, manage_engine=False, api_key="k1")) as keyed:
        assert httpx.get(keyed.url + "/v1/models", timeout=30).status_code == 401
        assert (
            httpx.get(
                keyed.url + "/v1/models", headers={"Authorization": "Bearer k1"}, timeout=30
            ).status_code
            == 200
        )
        assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200
