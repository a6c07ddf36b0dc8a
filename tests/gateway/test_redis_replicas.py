"""Two gateway processes sharing one real Redis enforce a tenant's quota jointly; Redis outages follow
the policy's `on_store_error` and the gateways recover by themselves when Redis returns.

The gateways run `ctxgate serve` as real subprocesses. They use the metered, generation-free
`/v1/ctxgate/compress` path so no model has to be loaded (only the tokenizer).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis
import yaml

from ctxgate.gateway.keys import hash_key
from tests.gateway.clock import in_one_minute
from tests.support.redis import RedisServer
from tests.support.servers import ctxgate_env, ctxgate_replicas, free_port, write_policy
from tests.support.waiting import eventually

MODEL = "ctxgate-test"
KEYS = {
    "burst": "cg-burst-key",
    "burst-again": "cg-burst-again-key",
    "allow": "cg-allow-key",
    "deny": "cg-deny-key",
}
MESSAGES = [{"role": "user", "content": "What is the tallest mountain in Europe?"}]


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prompt_tokens(tokenizer) -> int:
    return tokenizer.count_chat(MESSAGES)


@pytest.fixture(scope="module")
def gateways(redis_module, prompt_tokens, tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    policy_dir = root / "policies"
    policy_dir.mkdir()
    write_policy(
        policy_dir,
        "shared-allow",
        "name: shared-allow\nmax_input_tokens: 256\ndocuments: {max_tokens: 128}\n"
        "quota: {tokens_per_minute: 1000000, on_store_error: allow}\n",
    )
    write_policy(
        policy_dir,
        "shared-deny",
        "name: shared-deny\nmax_input_tokens: 256\ndocuments: {max_tokens: 128}\n"
        "quota: {tokens_per_minute: 1000000, on_store_error: deny}\n",
    )
    # Room for exactly 10 requests (and half of an eleventh) per minute; "burst-again" is for a burst
    # that a minute boundary cut through.
    burst = {
        "policy": "shared-allow",
        "quota": {
            "tokens_per_minute": prompt_tokens * 10 + prompt_tokens // 2,
            "requests_per_minute": 100,
            "window": "fixed",  # epoch minutes: `_ledger` reads the minute's counter itself
        },
    }
    tenants = {
        "burst": {**burst, "keys": [{"sha256": hash_key(KEYS["burst"])}]},
        "burst-again": {**burst, "keys": [{"sha256": hash_key(KEYS["burst-again"])}]},
        "allow": {"policy": "shared-allow", "keys": [{"sha256": hash_key(KEYS["allow"])}]},
        "deny": {"policy": "shared-deny", "keys": [{"sha256": hash_key(KEYS["deny"])}]},
    }
    keys_file = root / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"tenants": tenants}))
    dead_upstream = f"http://127.0.0.1:{free_port()}"
    env = ctxgate_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", REDIS_URL=redis_module.url)
    args = [
        "--policy-dir",
        str(policy_dir),
        "--keys",
        str(keys_file),
        "--upstream",
        dead_upstream,
        "--served-model-name",
        MODEL,
        "--default-policy",
        "shared-allow",
    ]
    with ctxgate_replicas(args, root, env, ready_timeout_s=60) as urls:
        yield urls


async def _compress(client: httpx.AsyncClient, url: str, tenant: str) -> httpx.Response:
    return await client.post(
        f"{url}/v1/ctxgate/compress",
        json={"model": MODEL, "messages": MESSAGES},
        headers={"authorization": f"Bearer {KEYS[tenant]}"},
    )


def _ledger(redis_url: str, tenant: str, minute: int) -> int:
    """The tenant's tokens in one minute window, read from Redis itself."""
    value = redis.Redis.from_url(redis_url).get(f"ctxgate:quota:{{{tenant}}}:tpm:{minute}")
    return int(value or 0)


def _counted(redis_url: str, tenant: str) -> int:
    """The tenant's tokens in its sliding minute (the default window), read from Redis itself: one
    counter per second in a hash, whatever minute boundary passed since the last request."""
    seconds = redis.Redis.from_url(redis_url).hgetall(f"ctxgate:quota:{{{tenant}}}:tpm")
    return sum(int(tokens) for tokens in seconds.values())


def test_two_replicas_share_one_tokens_per_minute_ledger(gateways, redis_module, prompt_tokens):
    limit = prompt_tokens * 10 + prompt_tokens // 2

    async def burst(tenant: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            # One request through each replica first, then a concurrent burst split across both.
            warmup = [await _compress(client, url, tenant) for url in gateways]
            return warmup + list(
                await asyncio.gather(*(_compress(client, gateways[i % 2], tenant) for i in range(30)))
            )

    def attempt(tenant: str, minute: int) -> tuple[list[httpx.Response], int]:
        return asyncio.run(burst(tenant)), _ledger(redis_module.url, tenant, minute)

    responses, ledger = in_one_minute(attempt, ["burst", "burst-again"])
    admitted = [r for r in responses if r.status_code == 200]
    assert [r.status_code for r in responses[:2]] == [200, 200]
    assert {r.status_code for r in responses} == {200, 429}
    assert len(admitted) == 10, [r.status_code for r in responses]
    admitted_tokens = sum(r.json()["report"]["prompt_tokens"] for r in admitted)
    assert admitted_tokens <= limit  # overshoot is bounded by one reservation; here exact
    assert ledger == admitted_tokens

    def replica(response: httpx.Response) -> str:
        return str(response.request.url).split("/v1")[0]

    # Each replica turned requests away because of what both admitted: one ledger, not two.
    assert {replica(r) for r in responses if r.status_code == 429} == set(gateways)
    rejected = next(r for r in responses if r.status_code == 429)
    assert 1 <= int(rejected.headers["retry-after"]) <= 60
    assert rejected.json()["error"]["code"] == "tokens_per_minute"
    # Each admitted request saw exactly what the shared ledger had left after its own reservation.
    left = sorted(
        (int(r.headers["x-ratelimit-remaining-tokens"]), int(r.headers["x-ratelimit-remaining-requests"]))
        for r in admitted
    )
    assert left == [(limit - k * prompt_tokens, 100 - k) for k in range(10, 0, -1)]
    assert (
        rejected.headers["x-ratelimit-limit-tokens"],
        rejected.headers["x-ratelimit-remaining-tokens"],
    ) == (str(limit), str(prompt_tokens // 2))
    assert (
        rejected.headers["x-ratelimit-limit-requests"],
        rejected.headers["x-ratelimit-remaining-requests"],
    ) == ("100", "90")
    assert rejected.headers["x-ratelimit-reset-tokens"] == rejected.headers["retry-after"] + "s"
    assert f"of {limit} tokens a minute used" in rejected.json()["error"]["message"]


def test_redis_outage_follows_on_store_error_then_recovers(gateways, redis_module):
    first, second = gateways

    async def call(url, tenant):
        async with httpx.AsyncClient(timeout=30) as client:
            return await _compress(client, url, tenant)

    assert asyncio.run(call(first, "allow")).status_code == 200
    assert asyncio.run(call(first, "deny")).status_code == 200
    assert _counted(redis_module.url, "allow") > 0

    redis_module.stop()
    try:
        assert asyncio.run(call(first, "allow")).status_code == 200  # on_store_error: allow
        denied = asyncio.run(call(second, "deny"))  # on_store_error: deny
        assert denied.status_code == 503
        assert denied.json()["error"]["code"] == "quota_store_unavailable"
        not_ready = httpx.get(f"{first}/ready")
        assert not_ready.status_code == 503 and not_ready.json()["store"] is False
        metrics = httpx.get(f"{first}/metrics").text
        assert 'ctxgate:quota_store_errors_total{action="allow"} 1.0' in metrics
        assert "ctxgate:quota_store_up 0.0" in metrics
        assert 'ctxgate:quota_store_errors_total{action="deny"} 1.0' in httpx.get(f"{second}/metrics").text
    finally:
        redis_module.start()  # same port, empty data

    eventually(
        lambda: asyncio.run(call(second, "deny")).status_code == 200,
        timeout_s=10,
        interval_s=0.2,
        message="gateway did not recover after Redis came back",
    )
    assert asyncio.run(call(first, "allow")).status_code == 200
    assert _counted(redis_module.url, "allow") > 0  # counted in the restarted (empty) Redis again
    assert "ctxgate:quota_store_up 1.0" in httpx.get(f"{first}/metrics").text
    ready = httpx.get(f"{first}/ready").json()
    assert ready["store"] is True and ready["store_kind"] == "redis"
