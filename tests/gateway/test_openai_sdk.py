"""The real OpenAI SDK against a real uvicorn server running the gateway and the real model."""

from __future__ import annotations

import re

import httpx
import pytest
from openai import OpenAI

from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import ServerThread, wait_http, write_policy

SMALL_POLICY = """
name: small
max_input_tokens: 200
reserve_output_tokens: 8
documents: {max_tokens: 150}
cost: {prompt_per_1k: 0.5, completion_per_1k: 1.5, currency: USD}
"""

PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, France. It was designed by the company "
    "of Gustave Eiffel and completed in 1889 for the World's Fair. "
)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    policy_dir = tmp_path_factory.mktemp("policies")
    write_policy(policy_dir, "small", SMALL_POLICY)
    settings = GatewaySettings(
        policy_dir=policy_dir, default_policy="small", served_model_name="ctxgate-test"
    )
    app = create_app(settings, engine=engine)
    with ServerThread(app) as running:
        running.app = app
        yield running


@pytest.fixture
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused-in-open-mode", max_retries=0, timeout=60)


def _documents(tokenizer, budget: int, factor: int = 5) -> list[dict]:
    """Documents whose total size is `factor` times the budget."""
    documents, total = [], 0
    while total < factor * budget:
        text = PASSAGE * 2
        documents.append({"id": f"d{len(documents)}", "title": f"Doc {len(documents)}", "text": text})
        total += tokenizer.count(text)
    return documents


def _scrape(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+0-9.eE]+|NaN)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def test_chat_completion_budget_enforced_with_documents_five_times_over(client, server, tokenizer):
    documents = _documents(tokenizer, 200)
    response = client.chat.completions.create(
        model="ctxgate-test",
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "When was the Eiffel Tower completed?"},
        ],
        max_tokens=6,
        temperature=0,
        extra_body={"ctxgate": {"documents": documents, "policy": "small"}},
    )
    assert response.choices[0].message.content is not None
    assert response.choices[0].finish_reason in ("stop", "length")
    usage = response.usage.model_dump()
    ctx = usage["ctxgate"]
    assert ctx["policy"] == "small"
    assert usage["prompt_tokens"] == ctx["prompt_tokens"] <= 200
    assert ctx["original_prompt_tokens"] >= 5 * 150
    assert sum(ctx["saved_tokens"].values()) == ctx["original_prompt_tokens"] - ctx["prompt_tokens"]
    # Every stage, and the embedding they waited for under its own key.
    assert set(ctx["compression_ms"]) == set(ctx["saved_tokens"]) | {"embedding"}
    assert 1 <= usage["completion_tokens"] <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    for field in ("queue_ms", "prefill_ms", "ttft_ms", "cached_prompt_tokens"):
        assert field in ctx
    assert ctx["compression_wait_ms"] >= 0  # waiting for a compression worker, apart from the stages
    # embedding passes on the engine's thread: a part of the stages' time
    assert 0 <= ctx["compression_engine_ms"] <= sum(ctx["compression_ms"].values())
    assert ctx["ttft_ms"] > 0
    expected_cost = usage["prompt_tokens"] / 1000 * 0.5 + usage["completion_tokens"] / 1000 * 1.5
    assert ctx["cost"] == pytest.approx(expected_cost, rel=1e-6)


def test_max_tokens_is_clamped_to_the_policy(client):
    response = client.chat.completions.create(
        model="ctxgate-test",
        messages=[{"role": "user", "content": "Count from one to one hundred."}],
        max_tokens=500,
        temperature=0,
        extra_body={"ctxgate": {"policy": "small"}, "ignore_eos": True},
    )
    assert response.usage.completion_tokens == 8
    assert response.choices[0].finish_reason == "length"


def test_streamed_chat_completion_with_usage(client, tokenizer):
    stream = client.chat.completions.create(
        model="ctxgate-test",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ctxgate": {"documents": _documents(tokenizer, 200, factor=2)}},
    )
    pieces, finish_reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    assert "".join(pieces)
    assert len(finish_reasons) == 1
    assert usage is not None and usage["completion_tokens"] <= 5
    assert usage["ctxgate"]["prompt_tokens"] <= 200
    assert usage["ctxgate"]["policy"] == "small"


def test_usage_matches_metrics(client, server, tokenizer):
    before = _scrape(server.url)
    response = client.chat.completions.create(
        model="ctxgate-test",
        messages=[{"role": "user", "content": "Where is the tower?"}],
        max_tokens=4,
        temperature=0,
        extra_body={"ctxgate": {"documents": _documents(tokenizer, 200, 3)}},
    )
    after = _scrape(server.url)
    ctx = (
        response.usage.ctxgate
        if hasattr(response.usage, "ctxgate")
        else response.usage.model_extra["ctxgate"]
    )
    labels = '{policy="small",tenant="anonymous"}'

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta(f"ctxgate:prompt_tokens_original_total{labels}") == ctx["original_prompt_tokens"]
    assert delta(f"ctxgate:prompt_tokens_sent_total{labels}") == ctx["prompt_tokens"]
    assert delta(f"ctxgate:completion_tokens_total{labels}") == response.usage.completion_tokens
    for stage, saved in ctx["saved_tokens"].items():
        assert delta(f'ctxgate:saved_tokens_total{{policy="small",stage="{stage}"}}') == saved
    assert delta('ctxgate:spend_total{currency="USD",tenant="anonymous"}') == pytest.approx(
        ctx["cost"], abs=1e-9
    )
    assert delta("ctxgate:gateway_ttft_seconds_count") == 1
    assert delta('ctxgate:gateway_requests_total{endpoint="/v1/chat/completions",status="200"}') == 1
    assert delta("ctxgate:compression_wait_seconds_count") == 1
    assert delta("ctxgate:compression_wait_seconds_sum") == pytest.approx(
        ctx["compression_wait_ms"] / 1000, abs=1e-5
    )


def test_completions_models_and_compress(client, server, tokenizer):
    models = client.models.list()
    assert [m.id for m in models.data][0] == "ctxgate-test"
    assert models.data[0].model_extra["engine_path"]["device"] == "cpu"  # which compute path serves
    completion = client.completions.create(
        model="ctxgate-test", prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert completion.usage.prompt_tokens == tokenizer.count("The capital of France is")
    assert completion.usage.completion_tokens <= 3

    body = {
        "model": "ctxgate-test",
        "messages": [{"role": "user", "content": "When was it built?"}],
        "ctxgate": {"documents": _documents(tokenizer, 200), "policy": "small"},
    }
    report = httpx.post(f"{server.url}/v1/ctxgate/compress", json=body).json()
    assert report["report"]["prompt_tokens"] <= 200
    assert tokenizer.count_chat(report["messages"]) == report["report"]["prompt_tokens"]
    assert report["report"]["original_prompt_tokens"] > 5 * 150


def test_health_ready_and_policies(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    wait_http(f"{server.url}/ready", timeout_s=300)  # once its embedding model has loaded
    ready = httpx.get(f"{server.url}/ready")
    assert ready.status_code == 200 and ready.json()["engine"] is True and ready.json()["embedder"] is True
    listing = httpx.get(f"{server.url}/v1/ctxgate/policies").json()
    names = {p["name"] for p in listing["policies"]}
    assert {"passthrough", "rag-default", "rag-strict", "chat-long-history", "small"} <= names
    assert listing["last_reload_error"] is None
