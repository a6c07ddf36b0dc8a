"""Issue 52's acceptance on two `ctxgate serve` replicas sharing one real Redis: a tenant with 3,000
tokens a minute sends 20-passage NQ requests (about 2,500 tokens each before compression) back to
back, alternating between both replicas. With `fit.quota: compress` every request is served (200, the fit
reported where it was fitted) until what is left cannot give a prompt the floor, and the window's total never exceeds
3,000 plus one reservation.

The replicas use the metered, generation-free `/v1/ctxgate/compress` (no model to load, only the
tokenizer and the embedding model), so the reservation is the prompt itself.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis
import yaml

from ctxgate.eval.datasets import load_dataset, resolve_dataset_path
from ctxgate.gateway.keys import hash_key
from tests.gateway.clock import in_one_minute
from tests.support.redis import RedisServer
from tests.support.servers import ctxgate_env, ctxgate_replicas, free_port, write_policy

MODEL = "ctxgate-test"
TPM = 3_000
FLOOR = 200
MAX_INPUT = 1_024
KEYS = {"burst": "cg-fit-burst-key", "burst-again": "cg-fit-burst-again-key"}
SYSTEM = "You answer questions from the passages. Reply with a short phrase."
# One at a time: with several reservations of the full budget in flight, every request can see either
# the full budget or less than the floor left, and none is fitted (the concurrent burst's bound is
# tests/gateway/test_fit_http.py's).
IN_FLIGHT = 1


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(redis_module, tmp_path_factory):
    root = tmp_path_factory.mktemp("fit-replicas")
    policy_dir = root / "policies"
    policy_dir.mkdir()
    write_policy(
        policy_dir,
        "fitq",
        f"name: fitq\nmax_input_tokens: {MAX_INPUT}\ndocuments: {{max_tokens: 900}}\n"
        "rerank: {method: bm25}\ndedup: {near_duplicate_cosine: null}\n"
        f"quota: {{tokens_per_minute: {TPM}, window: fixed}}\nfit: {{quota: compress, min_context_tokens: {FLOOR}}}\n",
    )
    tenants = {name: {"policy": "fitq", "keys": [{"sha256": hash_key(key)}]} for name, key in KEYS.items()}
    keys_file = root / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"tenants": tenants}))
    env = ctxgate_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", REDIS_URL=redis_module.url)
    args = [
        "--policy-dir",
        str(policy_dir),
        "--keys",
        str(keys_file),
        "--upstream",
        f"http://127.0.0.1:{free_port()}",
        "--served-model-name",
        MODEL,
        "--default-policy",
        "fitq",
    ]
    with ctxgate_replicas(args, root, env, ready_timeout_s=90) as urls:
        yield urls


@pytest.fixture(scope="module")
def examples():
    return load_dataset(resolve_dataset_path("nq-multidoc-dev.jsonl"), limit=20).examples


def _ledger(redis_url: str, tenant: str, minute: int) -> int:
    """The fixed minute window's tokens (the policy counts per calendar minute, to read one window)."""
    value = redis.Redis.from_url(redis_url).get(f"ctxgate:quota:{{{tenant}}}:tpm:{minute}")
    return int(value or 0)


def test_a_burst_across_two_replicas_is_fitted_until_the_floor(replicas, redis_module, examples):
    async def burst(tenant: str) -> list[httpx.Response]:
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def one(client: httpx.AsyncClient, index: int, example) -> httpx.Response:
            async with gate:
                return await client.post(
                    f"{replicas[index % 2]}/v1/ctxgate/compress",
                    json={
                        "model": MODEL,
                        "messages": [
                            {"role": "system", "content": SYSTEM},
                            {"role": "user", "content": example.question},
                        ],
                        "ctxgate": {"documents": example.documents()},
                    },
                    headers={"authorization": f"Bearer {KEYS[tenant]}"},
                )

        async with httpx.AsyncClient(timeout=300) as client:
            return list(await asyncio.gather(*(one(client, i, e) for i, e in enumerate(examples))))

    def attempt(tenant: str, minute: int) -> tuple[list[httpx.Response], int]:
        return asyncio.run(burst(tenant)), _ledger(redis_module.url, tenant, minute)

    started = time.perf_counter()
    responses, ledger = in_one_minute(attempt, list(KEYS))
    elapsed = time.perf_counter() - started
    assert {r.status_code for r in responses} == {200, 429}, [r.text[:200] for r in responses]
    served = [r.json()["report"] for r in responses if r.status_code == 200]
    # About 2,500 tokens each before compression: the quota holds barely one at that size.
    assert sum(report["original_prompt_tokens"] for report in served) > 2 * MAX_INPUT * len(served)
    fitted = [report for report in served if "fit" in report]
    # Compressed at the normal budget a request takes at most about 700 tokens, so the remainder
    # under 1,024 always has a fitted request's worth before it falls under the floor.
    assert fitted, [r.text[:300] for r in responses if r.status_code != 200]
    for report in fitted:
        assert report["fit"]["bound_by"] == "quota" and FLOOR <= report["fit"]["budget"] < MAX_INPUT
        assert report["prompt_tokens"] <= report["fit"]["budget"]
    # The burst was split across both replicas, and each served from the one shared ledger.
    assert {str(r.request.url).split("/v1")[0] for r in responses if r.status_code == 200} == set(replicas)
    # Every refusal is the floor's: what was left could not give a prompt min_context_tokens.
    for refused in (r for r in responses if r.status_code == 429):
        error = refused.json()["error"]
        assert error["code"] == "tokens_per_minute" and "min_context_tokens" in error["message"], error
    assert ledger == sum(report["prompt_tokens"] for report in served)
    assert ledger <= TPM + MAX_INPUT  # the window's total: the limit plus one reservation at most
    assert TPM - ledger < FLOOR  # served down to the floor
    print(f"{len(served)} served ({len(fitted)} fitted), {ledger} tokens in the window, {elapsed:.1f}s")
