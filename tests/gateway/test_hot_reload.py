"""Policy files are hot-reloaded: valid edits apply without restart; invalid ones keep the old policy."""

from __future__ import annotations

import json

import httpx
import pytest

from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import ServerThread, write_policy
from tests.support.waiting import eventually

PASSAGE = "Paris is the capital of France and its largest city, on the Seine. " * 3


def _policy(max_input: int) -> str:
    # Only budget fitting (no dedup/rerank/extraction), so the prompt size tracks the budget.
    return (
        f"name: live\nmax_input_tokens: {max_input}\nreserve_output_tokens: 4\n"
        f"documents: {{max_tokens: {max_input}}}\ndedup: {{enabled: false}}\nrerank: {{enabled: false}}\n"
        "extraction: {enabled: false}\n"
    )


@pytest.fixture
def server(engine, tmp_path):
    write_policy(tmp_path, "live", _policy(300))
    settings = GatewaySettings(policy_dir=tmp_path, default_policy="live", reload_interval_s=0.5)
    with ServerThread(create_app(settings, engine=engine)) as running:
        running.policy_dir = tmp_path
        yield running


def _compress(server) -> dict:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Capital?"}],
        "ctxgate": {"documents": [{"text": f"Fact {i}. {PASSAGE}"} for i in range(12)]},
    }
    response = httpx.post(f"{server.url}/v1/ctxgate/compress", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["report"]


def _effective(server) -> dict:
    listing = httpx.get(f"{server.url}/v1/ctxgate/policies").json()
    return {p["name"]: p for p in listing["policies"]}["live"], listing


def _wait_for(predicate, timeout_s: float = 5.0):
    return eventually(predicate, timeout_s=timeout_s, interval_s=0.1)


def test_valid_edit_applies_and_invalid_edit_keeps_old_policy(server):
    first = _compress(server)
    assert 200 < first["prompt_tokens"] <= 300

    write_policy(server.policy_dir, "live", _policy(150))
    _wait_for(lambda: _effective(server)[0]["effective"]["max_input_tokens"] == 150)
    assert _compress(server)["prompt_tokens"] <= 150

    path = write_policy(server.policy_dir, "live", "name: live\nmax_input_tokens: many\n")
    _, listing = _wait_for(lambda: (r := _effective(server))[1]["last_reload_error"] and r)
    error = listing["last_reload_error"]
    # The file's name, never the server's directory (the metrics below are the operator's view).
    assert error["file"] == path.name and error["message"].startswith("live.yaml: field 'max_input_tokens'")
    assert str(server.policy_dir) not in json.dumps(listing)
    assert _effective(server)[0]["effective"]["max_input_tokens"] == 150
    assert _compress(server)["prompt_tokens"] <= 150
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'ctxgate:policy_reload_failures_total{{file="{path}"}} 1.0' in metrics
    assert f'ctxgate:policy_reload_error{{file="{path}"}} 1.0' in metrics

    write_policy(server.policy_dir, "live", _policy(250))
    _wait_for(lambda: _effective(server)[0]["effective"]["max_input_tokens"] == 250)
    assert _effective(server)[1]["last_reload_error"] is None


def test_new_policy_file_becomes_available(server):
    write_policy(
        server.policy_dir, "fresh", "name: fresh\nmax_input_tokens: 120\ndocuments: {max_tokens: 60}\n"
    )
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Capital?"}],
        "ctxgate": {"policy": "fresh", "documents": [{"text": f"Fact {i}. {PASSAGE}"} for i in range(4)]},
    }
    response = _wait_for(
        lambda: (
            (r := httpx.post(f"{server.url}/v1/ctxgate/compress", json=body, timeout=60)).status_code == 200
            and r
        )
    )
    assert response.json()["report"]["prompt_tokens"] <= 120
