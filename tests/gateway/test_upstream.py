"""The HTTP upstream client: a gateway forwarding to another OpenAI-compatible server (here a second
ctxgate gateway running the real model), with failover, streaming passthrough and abort on disconnect."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import OpenAI

from ctxgate.backend.engine.api import EngineClient, GenerationRequest, SamplingParams
from ctxgate.backend.routing.upstream import UpstreamClient, UpstreamConfig, UpstreamUnavailable
from ctxgate.gateway.app import create_app
from ctxgate.gateway.quota import QuotaLimits
from ctxgate.gateway.settings import GatewaySettings
from ctxgate.policies.loader import load_policy_file, packaged_policy_dir
from tests.gateway.conftest import RecordingEngine
from tests.support.servers import ServerThread, free_port, wait_http
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def backend_server(engine):
    recording = RecordingEngine(engine)
    settings = GatewaySettings(default_policy="passthrough")
    with ServerThread(create_app(settings, engine=recording)) as running:
        running.engine = recording
        yield running


@pytest.fixture(scope="module")
def front(backend_server):
    dead = f"http://127.0.0.1:{free_port()}"
    settings = GatewaySettings(
        upstreams=[dead, f"{backend_server.url}/v1"],
        served_model_name="front",
        default_policy="passthrough",
        upstream_connect_timeout_s=0.5,
    )
    app = create_app(settings)
    with ServerThread(app) as running:
        running.upstream = app.state.gateway.engine
        yield running


def test_upstream_discovers_model_and_is_ready(front):
    upstream = front.upstream
    assert isinstance(upstream, UpstreamClient)
    assert upstream.is_ready()
    assert upstream._upstream_model == "SmolLM2-135M-Instruct"
    wait_http(f"{front.url}/ready", timeout_s=300)  # once its embedding model has loaded


def test_failover_and_streaming_passthrough(front):
    client = OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
    for _ in range(2):  # round robin starts at each URL once; the dead one is skipped either way
        response = client.chat.completions.create(
            model="front", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0
        )
        assert response.choices[0].message.content
        assert 1 <= response.usage.completion_tokens <= 4
        assert response.usage.model_extra["ctxgate"]["ttft_ms"] > 0
    stream = client.chat.completions.create(
        model="front",
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == response.choices[0].message.content  # greedy: same as the non-streamed answer
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens
    completion = client.completions.create(model="front", prompt="One, two,", max_tokens=3, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens <= 3


def test_client_disconnect_aborts_upstream_request(front, backend_server):
    recording = backend_server.engine
    before = len(recording.cut_short)
    body = {
        "model": "front",
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{front.url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        received = 0
        for line in response.iter_lines():
            if line.startswith("data:"):
                received += 1
            if received >= 3:
                break  # leave mid-stream
    eventually(
        lambda: len(recording.cut_short) > before,
        timeout_s=10,
        message="the upstream request was not aborted",
    )
    assert len(recording.finished) >= 1  # earlier requests did finish normally


async def test_all_upstreams_down_is_a_clear_502():
    ports = [free_port(), free_port()]
    client = UpstreamClient(
        UpstreamConfig(
            urls=[f"http://127.0.0.1:{p}" for p in ports], model="m", connect_timeout_s=0.2, retries=1
        )
    )
    # The declared interface, nothing probed: a remote engine has no local tokenizer or metrics.
    assert isinstance(client, EngineClient)
    assert client.tokenizer is None and client.metrics_registry is client.metrics.registry
    assert client.needs_health_check and not client.is_ready()
    request = GenerationRequest(
        "r1", [1, 2, 3], SamplingParams(max_tokens=2), messages=[{"role": "user", "content": "x"}]
    )
    with pytest.raises(UpstreamUnavailable) as info:
        async for _ in client.generate(request):
            pass
    assert info.value.status_code == 502
    assert client.connection_errors == 4  # two URLs, one retry each
    assert not await client.check_health()
    assert client.needs_health_check  # still nothing learned: the gateway keeps probing
    await client.stop()


def test_gateway_reports_upstream_errors_as_json(tmp_path):
    settings = GatewaySettings(
        upstreams=[f"http://127.0.0.1:{free_port()}"],
        served_model_name="m",
        upstream_model="m",
        upstream_connect_timeout_s=0.2,
        upstream_retries=0,
    )
    app = create_app(settings)
    with ServerThread(app) as running:
        response = httpx.post(
            f"{running.url}/v1/chat/completions",
            timeout=30,
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert response.status_code == 502
        # Generic, with the request id to quote; the upstream's URL stays in the log.
        message = response.json()["error"]["message"]
        assert message == f"the model backend failed (request id {response.headers['x-request-id']})"
        assert "127.0.0.1" not in response.text
        assert 'ctxgate:upstream_errors_total{status="502"} 1.0' in httpx.get(f"{running.url}/metrics").text
        assert httpx.get(f"{running.url}/ready").status_code == 503
        # Streamed too: the engine is asked before headers go out, so the failure is a real status.
        streamed = httpx.post(
            f"{running.url}/v1/chat/completions",
            timeout=30,
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "stream": True,
            },
        )
        assert (
            streamed.status_code == 502 and "the model backend failed" in streamed.json()["error"]["message"]
        )
        # Requests the backend never served give their reserved tokens back.
        limits = QuotaLimits.from_policy(load_policy_file(packaged_policy_dir() / "rag-default.yaml").quota)
        ledger = asyncio.run(app.state.gateway.store.usage("anonymous", limits))
        assert {u.name: u.used for u in ledger} == {"requests_per_minute": 2, "tokens_per_minute": 0}


def test_non_streamed_client_disconnect_aborts_generation(backend_server):
    recording = backend_server.engine
    before = len(recording.cut_short)
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{backend_server.url}/v1/chat/completions", json=body, timeout=1.0)
    eventually(
        lambda: len(recording.cut_short) > before,
        timeout_s=10,
        message="generation went on after the client left",
    )


def test_config_rejects_bad_urls():
    with pytest.raises(ValueError, match="http"):
        UpstreamConfig(urls=["localhost:8000"])
    with pytest.raises(ValueError, match="at least one"):
        UpstreamConfig(urls=[])
