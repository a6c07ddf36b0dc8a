"""Per-key lifecycle and limits, enforced jointly by two `ctxgate serve` replicas sharing a real Redis.

The replicas run from one config file (Redis URL through os.environ/). Generation goes to a real
HTTP upstream that holds each completion until the test releases it, so parallel-request slots can be
observed while they are held.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import yaml

from ctxgate.gateway.keys import hash_key
from tests.gateway.clock import in_one_minute
from tests.support.redis import RedisServer
from tests.support.servers import (
    ServerThread,
    ctxgate_env,
    ctxgate_replicas,
    write_policy,
)

REPO = Path(__file__).resolve().parents[2]
MODEL = "ctxgate-test"
MESSAGES = [{"role": "user", "content": "What is the tallest mountain in Europe?"}]
KEYS = {
    name: f"cg-{name}-key"
    for name in ("rpm", "rpm-again", "budget", "revoke", "expired", "models", "parallel")
}


class HeldUpstream:
    """An OpenAI-compatible upstream whose completions wait until `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.received = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            return await send({"type": "lifespan.shutdown.complete"})
        if scope["path"] == "/v1/models":
            return await self._send(
                send,
                b'{"object":"list","data":[{"id":"ctxgate-test","max_model_len":2048}]}',
                b"application/json",
            )
        while (await receive()).get("more_body"):
            pass
        self.received += 1
        while not self.release.is_set():
            await asyncio.sleep(0.02)
        events = (
            b'data: {"choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\ndata: [DONE]\n\n'
        )
        await self._send(send, events, b"text/event-stream")

    @staticmethod
    async def _send(send, body: bytes, content_type: bytes) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]}
        )
        await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def upstream():
    app = HeldUpstream()
    with ServerThread(app) as server:
        yield app, server.url


@pytest.fixture(scope="module")
def prompt_tokens(tokenizer) -> int:
    return tokenizer.count_chat(MESSAGES)


@pytest.fixture(scope="module")
def setup(redis_module, upstream, prompt_tokens, tmp_path_factory):
    root = tmp_path_factory.mktemp("key-replicas")
    (root / "policies").mkdir()
    write_policy(
        root / "policies",
        "priced",
        "name: priced\nmax_input_tokens: 256\nreserve_output_tokens: 2\n"
        "documents: {max_tokens: 128}\ncost: {prompt_per_1k: 1.0, completion_per_1k: 1.0}\n",
    )
    past = (datetime.now(UTC) - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    entries = {
        "rpm": {"limits": {"requests_per_minute": 3, "window": "fixed"}, "labels": {"team": "search"}},
        "rpm-again": {
            "limits": {"requests_per_minute": 3, "window": "fixed"}
        },  # for a burst a minute boundary cut through
        # Room for two compressions (prompt tokens at 1.0 per 1k) and half of a third, per day.
        "budget": {"limits": {"budget": prompt_tokens * 2.5 / 1000, "budget_period": "daily"}},
        "revoke": {},
        "expired": {"expires_at": past},
        "models": {"models": ["another-model"]},
        "parallel": {"limits": {"max_parallel_requests": 2}},
    }
    tenants = {name: {"keys": [{"sha256": hash_key(KEYS[name]), **entry}]} for name, entry in entries.items()}
    keys_file = root / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"tenants": tenants}))
    config = root / "ctxgate.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {"served_model_name": MODEL, "default_policy": "priced", "reload_interval": 0.2},
                "upstreams": {"urls": [upstream[1]], "model": MODEL},
                "redis": {"url": "os.environ/CG_TEST_REDIS"},
                "keys_file": "keys.yaml",
                "policy_dir": "policies",
            }
        )
    )
    env = ctxgate_env(CG_TEST_REDIS=redis_module.url)
    env.pop("REDIS_URL", None)
    with ctxgate_replicas(["--config", str(config)], root, env, ready_timeout_s=60, must_stop=True) as urls:
        yield urls, keys_file


def _compress(url: str, key: str, model: str = MODEL) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/ctxgate/compress",
        json={"model": model, "messages": MESSAGES},
        headers={"authorization": f"Bearer {KEYS[key]}"},
        timeout=30,
    )


def test_key_requests_per_minute_is_shared_by_both_replicas(setup):
    urls, _ = setup
    key, responses = in_one_minute(
        lambda key, _: (key, [_compress(urls[i % 2], key) for i in range(6)]), ["rpm", "rpm-again"]
    )
    assert [r.status_code for r in responses] == [200, 200, 200, 429, 429, 429]
    refused = responses[3:]
    assert {str(r.request.url).split("/v1")[0] for r in refused} == set(urls)
    for response in refused:
        assert 1 <= int(response.headers["retry-after"]) <= 60
        error = response.json()["error"]
        assert error["code"] == "requests_per_minute"
        retry = response.headers["retry-after"]
        assert error["message"].startswith(
            f"API key '{hash_key(KEYS[key])[:12]}' is over its requests_per_minute quota: "
            f"3 of 3 requests a minute used, this request needs 1; the limit resets in {retry}s ("
        )
        assert error["quota"]["reset_s"] == int(retry) and error["quota"]["scope"] == "key"
        assert (
            response.headers["x-ratelimit-limit-requests"],
            response.headers["x-ratelimit-remaining-requests"],
        ) == ("3", "0")


def test_key_budget_with_a_period(setup):
    urls, _ = setup
    statuses = [_compress(urls[i % 2], "budget").status_code for i in range(2)]
    refused = _compress(urls[0], "budget")
    assert statuses == [200, 200] and refused.status_code == 429
    assert refused.json()["error"]["code"] == "budget"
    seconds_to_midnight = 86400 - time.time() % 86400
    assert abs(int(refused.headers["retry-after"]) - seconds_to_midnight) <= 2


def test_revoked_and_expired_keys_get_401_with_the_reason(setup):
    urls, keys_file = setup
    assert [_compress(url, "revoke").status_code for url in urls] == [200, 200]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxgate",
            "keys",
            "revoke",
            hash_key(KEYS["revoke"])[:10],
            "--keys",
            str(keys_file),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    for url in urls:
        deadline = time.monotonic() + 10
        while (response := _compress(url, "revoke")).status_code == 200:
            assert time.monotonic() < deadline, "the replica did not pick up the revocation"
            time.sleep(0.1)
        assert response.status_code == 401
        assert (
            f"API key {hash_key(KEYS['revoke'])[:12]} was revoked at " in response.json()["error"]["message"]
        )
    expired = _compress(urls[1], "expired")
    assert expired.status_code == 401 and "expired at" in expired.json()["error"]["message"]


def test_model_allow_list(setup):
    urls, _ = setup
    refused = _compress(urls[0], "models")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    assert "another-model" in refused.json()["error"]["message"]


def test_max_parallel_requests_across_replicas(setup, upstream):
    urls, _ = setup
    held, _ = upstream
    held.release.clear()
    before = held.received

    async def complete(client: httpx.AsyncClient, url: str) -> httpx.Response:
        return await client.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
            headers={"authorization": f"Bearer {KEYS['parallel']}"},
        )

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            running = [asyncio.create_task(complete(client, url)) for url in urls]
            deadline = time.monotonic() + 20
            while held.received < before + 2:  # both replicas hold a slot, waiting on the upstream
                assert time.monotonic() < deadline, "the upstream never saw both requests"
                await asyncio.sleep(0.05)
            third = await complete(client, urls[0])
            held.release.set()
            finished = await asyncio.gather(*running)
            after = await complete(client, urls[1])  # the slots were given back
            return third, finished, after

    third, finished, after = asyncio.run(scenario())
    assert third.status_code == 429 and third.json()["error"]["code"] == "max_parallel_requests"
    assert third.headers["retry-after"] == "1"
    assert [r.status_code for r in finished] == [200, 200] and after.status_code == 200
