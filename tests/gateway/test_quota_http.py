"""Quotas through HTTP with the in-process store: 429 + Retry-After, reserve-then-reconcile, spend."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from ctxgate.gateway.app import create_app
from ctxgate.gateway.quota import QuotaLimits
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.clock import FakeClock
from tests.support.servers import ServerThread, write_policy

START = 1_700_000_040.0 + 5  # 5 s into a minute, far from the end of the UTC day


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory, clock):
    policy_dir = tmp_path_factory.mktemp("quota")
    write_policy(
        policy_dir,
        "rpm",
        "name: rpm\nmax_input_tokens: 128\nreserve_output_tokens: 2\n"
        "documents: {max_tokens: 64}\nquota: {requests_per_minute: 2, window: fixed}\n",
    )
    write_policy(
        policy_dir,
        "priced",
        "name: priced\nmax_input_tokens: 128\nreserve_output_tokens: 8\n"
        "documents: {max_tokens: 64}\ncost: {prompt_per_1k: 1.0, completion_per_1k: 2.0}\n"
        "quota: {tokens_per_day: 1000000, spend_per_day: 0.05}\n",
    )
    write_policy(
        policy_dir,
        "limited",
        "name: limited\nmax_input_tokens: 128\nreserve_output_tokens: 2\n"
        "documents: {max_tokens: 64}\nquota: {requests_per_minute: 3, tokens_per_minute: 100000, window: fixed}\n",
    )
    write_policy(
        policy_dir,
        "free",
        "name: free\nmax_input_tokens: 128\nreserve_output_tokens: 2\ndocuments: {max_tokens: 64}\n",
    )
    app = create_app(GatewaySettings(policy_dir=policy_dir), engine=engine, clock=clock)
    with ServerThread(app) as running:
        running.store = app.state.gateway.store
        yield running


def _chat(policy: str, max_tokens: int = 1) -> dict:
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Say one word."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ctxgate": {"policy": policy},
    }


def _compress(server, policy: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/ctxgate/compress", json=_chat(policy), timeout=60)


def test_requests_per_minute_gives_429_with_retry_after(server, clock):
    clock.advance(20)  # 25 s into the minute: 35 s to its end
    statuses = [_compress(server, "rpm") for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    rejected = statuses[-1]
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    assert rejected.json()["error"]["code"] == "requests_per_minute"
    assert rejected.headers["retry-after"] == "35"
    assert (
        'ctxgate:quota_rejections_total{reason="requests_per_minute",tenant="anonymous"} 1.0'
        in httpx.get(f"{server.url}/metrics").text
    )
    clock.advance(34)  # still the same minute
    assert _compress(server, "rpm").status_code == 429
    clock.advance(1)  # the next minute has room again
    assert [_compress(server, "rpm").status_code for _ in range(3)] == [200, 200, 429]


def _today(server) -> dict[str, int]:
    """The "priced" policy's day counters (spend in micro-units)."""
    limits = QuotaLimits(tokens_per_day=1_000_000, spend_per_day=0.05)
    return {u.name: u.used for u in asyncio.run(server.store.usage("anonymous", limits))}


def test_reservation_is_reconciled_to_the_real_count_and_spend(server):
    before = _today(server)
    response = httpx.post(f"{server.url}/v1/chat/completions", json=_chat("priced", max_tokens=8), timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    after = _today(server)
    # Reserved prompt + 8 tokens; the ledger keeps what was really used.
    assert after["tokens_per_day"] - before["tokens_per_day"] == usage["total_tokens"]
    spent_micros = after["spend_per_day"] - before["spend_per_day"]
    assert spent_micros == round(usage["ctxgate"]["cost"] * 1_000_000)
    assert usage["ctxgate"]["cost"] == pytest.approx(
        usage["prompt_tokens"] / 1000 * 1.0 + usage["completion_tokens"] / 1000 * 2.0
    )


def test_spend_per_day_is_enforced(server, clock):
    statuses = []
    for _ in range(60):  # ~0.03-0.05 cost units per request against a 0.05 daily budget
        response = httpx.post(
            f"{server.url}/v1/chat/completions", json=_chat("priced", max_tokens=1), timeout=60
        )
        statuses.append(response.status_code)
        if response.status_code == 429:
            break
    assert statuses[-1] == 429
    assert response.json()["error"]["code"] == "spend_per_day"
    assert (
        int(response.headers["retry-after"]) == 86400 - clock() % 86400
    )  # to the end of the clock's UTC day


RATE_HEADERS = {
    f"x-ratelimit-{what}-{unit}"
    for what in ("limit", "remaining", "reset")
    for unit in ("requests", "tokens")
}


def _streamed_usage(server, body: dict) -> tuple[httpx.Headers, dict]:
    """A streamed chat's headers and its final usage chunk."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        return response.headers, next(chunk["usage"] for chunk in chunks if chunk.get("usage"))


def test_limited_answers_and_the_429_carry_the_rate_limit_headers(server, clock):
    clock.advance(60 - clock() % 60 + 10)  # a fresh minute, 50 s to its end
    first = httpx.post(f"{server.url}/v1/chat/completions", json=_chat("limited", max_tokens=1), timeout=60)
    assert first.status_code == 200, first.text
    used = first.json()["usage"]
    # The reservation (prompt + the 1 output token asked) is what the headers count down from.
    assert {name: first.headers[name] for name in RATE_HEADERS} == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "50s",
        "x-ratelimit-limit-tokens": "100000",
        "x-ratelimit-remaining-tokens": str(100000 - used["prompt_tokens"] - 1),
        "x-ratelimit-reset-tokens": "50s",
    }
    clock.advance(5)
    headers, streamed = _streamed_usage(
        server, _chat("limited", max_tokens=1)
    )  # known before the first token
    assert headers["x-ratelimit-remaining-requests"] == "1"
    # The first request was reconciled to what it used before the second reserved.
    assert (
        int(headers["x-ratelimit-remaining-tokens"])
        == 100000 - used["total_tokens"] - streamed["prompt_tokens"] - 1
    )
    assert headers["x-ratelimit-reset-tokens"] == "45s"
    third = httpx.post(f"{server.url}/v1/chat/completions", json=_chat("limited", max_tokens=1), timeout=60)
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    spent = used["total_tokens"] + streamed["total_tokens"] + third.json()["usage"]["total_tokens"]
    clock.advance(7)
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=_chat("limited", max_tokens=1), timeout=60)
    assert refused.status_code == 429
    assert RATE_HEADERS <= set(refused.headers)
    assert (
        refused.headers["x-ratelimit-remaining-requests"],
        refused.headers["x-ratelimit-limit-requests"],
    ) == ("0", "3")
    assert refused.headers["x-ratelimit-remaining-tokens"] == str(100000 - spent)
    assert refused.headers["x-ratelimit-reset-requests"] == "38s" == refused.headers["retry-after"] + "s"
    message = refused.json()["error"]["message"]
    assert "3 of 3 requests a minute used" in message and "resets in 38s" in message, message


def test_a_tenant_without_limits_gets_no_rate_limit_headers(server, clock):
    response = httpx.post(f"{server.url}/v1/chat/completions", json=_chat("free"), timeout=60)
    assert response.status_code == 200, response.text
    assert not {name for name in response.headers if name.startswith("x-ratelimit")}
    compressed = _compress(server, "free")
    assert not {name for name in compressed.headers if name.startswith("x-ratelimit")}
    clock.advance(60)
    limited = _compress(server, "limited")
    assert limited.status_code == 200 and limited.headers["x-ratelimit-remaining-requests"] == "2"
