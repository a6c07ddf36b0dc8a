"""Tenants own their boundary: the policies, quotas, prices, models and indexes a key may use.

The attack: a key whose home policy carries a tokens-per-minute quota names a policy without one
(`passthrough`) and spends past its quota. It must not work in-process, in upstream mode, nor on
two `ctxgate serve` replicas sharing a real Redis; naming a policy the tenant may not use is a 403.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from ctxgate.gateway.key_admin import add_key
from ctxgate.gateway.keys import KeysFile, KeyStore, hash_key, read_keys_file
from ctxgate.gateway.policy_resolution import quota_cap, tenant_prices
from ctxgate.gateway.quota import InProcessQuotaStore, QuotaExceeded, QuotaLimits, RedisQuotaStore
from ctxgate.gateway.settings import GatewaySettings
from ctxgate.policies.loader import packaged_policy_dir, parse_policy
from tests.gateway.clock import FakeClock, in_one_minute
from tests.gateway.conftest import engine  # noqa: F401
from tests.support.servers import (
    ServerThread,
    ctxgate_env,
    ctxgate_replicas,
    write_policy,
)

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Which mountain is the tallest in Europe?"}]
KEYS = {
    name: f"cg-{name}-secret" for name in ("acme", "acme-again", "globex", "initech", "pricing", "models")
}
HOME = "home-strict"
START = 1_700_000_045.0  # in-process gateways run on a FakeClock from here: no minute ends mid-test
# Requests fit in the quota twice, not three times (see `quota_tokens`).
HOME_POLICY = (
    "name: home-strict\nmax_input_tokens: 256\nreserve_output_tokens: 1\ndocuments: {max_tokens: 128}\n"
    "cost: {prompt_per_1k: 1.0, completion_per_1k: 2.0}\nquota: {tokens_per_minute: %d}\n"
)
TINY_POLICY = (
    "name: tiny\nmax_input_tokens: 256\nreserve_output_tokens: 1\ndocuments: {max_tokens: 128}\n"
    "quota: {requests_per_minute: 1}\n"
)
PRICEY_POLICY = (
    "name: pricey\nmax_input_tokens: 256\nreserve_output_tokens: 1\ndocuments: {max_tokens: 128}\n"
    "compression_enabled: false\ncost: {prompt_per_1k: 5.0, completion_per_1k: 0.5}\n"
)


def _tenants() -> dict:
    key = {name: [{"sha256": hash_key(secret)}] for name, secret in KEYS.items()}
    return {
        "tenants": {
            # May name passthrough (no quota at all) and the others; its home quota still holds.
            "acme": {"policy": HOME, "policies": ["passthrough", "tiny", "pricey"], "keys": key["acme"]},
            # acme's twin, for a burst on the wall clock that a minute boundary cut through.
            "acme-again": {
                "policy": HOME,
                "policies": ["passthrough", "tiny", "pricey"],
                "keys": key["acme-again"],
            },
            "globex": {"policy": HOME, "keys": key["globex"]},  # its home policy only
            "initech": {"policy": HOME, "policies": ["tiny"], "keys": key["initech"]},
            # The tenant's own quota raises its home policy's; prices stay the home policy's.
            "pricing": {
                "policy": HOME,
                "policies": ["passthrough", "pricey"],
                "quota": {"tokens_per_minute": 1_000_000},
                "keys": key["pricing"],
            },
            "models": {"keys": [{"sha256": hash_key(KEYS["models"]), "models": ["front"]}]},
        }
    }


@pytest.fixture(scope="module")
def quota_tokens(tokenizer) -> tuple[int, int]:
    """(tokens one request reserves under passthrough with max_tokens=1, the tenant's quota)."""
    per_request = tokenizer.count_chat(MESSAGES) + 1
    return per_request, 2 * per_request + per_request // 2


@pytest.fixture(scope="module")
def files(tmp_path_factory, quota_tokens) -> Path:
    root = tmp_path_factory.mktemp("tenants")
    policy_dir = root / "policies"
    policy_dir.mkdir()
    write_policy(policy_dir, HOME, HOME_POLICY % quota_tokens[1])
    write_policy(policy_dir, "tiny", TINY_POLICY)
    write_policy(policy_dir, "pricey", PRICEY_POLICY)
    (root / "keys.yaml").write_text(yaml.safe_dump(_tenants()))
    return root


def _chat(policy: str | None = None, max_tokens: int = 1, model: str = MODEL) -> dict:
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    return body | ({"ctxgate": {"policy": policy}} if policy else {})


def _post(url: str, tenant: str, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(
        f"{url}{path}", json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"}, timeout=60
    )


def _until_refused(
    urls: list[str], tenant: str, body: dict, path: str = "/v1/chat/completions", most: int = 3
) -> list[httpx.Response]:
    """Requests (round robin over `urls`) up to and including the first refusal, at most `most`
    (two fit in the quota)."""
    responses = []
    for i in range(most):
        responses.append(_post(urls[i % len(urls)], tenant, body, path))
        if responses[-1].status_code != 200:
            break
    return responses


def _minute_used(store, tenant: str, quota: int) -> int:
    """What the tenant's tokens-per-minute limit holds now (the sliding minute)."""
    (minute,) = asyncio.run(store.usage(tenant, QuotaLimits(tokens_per_minute=quota)))
    return minute.used


def _assert_held_to_quota(responses: list[httpx.Response], used: int, quota: int) -> None:
    statuses = [r.status_code for r in responses]
    assert statuses[-1] == 429, (statuses, responses[-1].text)
    assert statuses[:2] == [200, 200] and set(statuses[:-1]) == {200}
    assert responses[-1].json()["error"]["code"] == "tokens_per_minute"
    # The ledger is the tenant's, whatever policy a request named: this minute stays within the quota.
    assert 0 < used <= quota


def _assert_policy_refused(response: httpx.Response, policy: str, tenant: str = "globex") -> None:
    assert response.status_code == 403, response.text
    # Only the key's own policies are named, never other tenants'.
    assert response.json()["error"] == {
        "message": f"API key {hash_key(KEYS[tenant])[:12]} may not use policy '{policy}' (it may use: {HOME})",
        "type": "permission_error",
        "param": "ctxgate.policy",
        "code": "policy_not_allowed",
    }


# -- limits and prices, as functions ---------------------------------------------------------------
def _policy(text: str):
    return parse_policy(yaml.safe_load(text), "test")


def test_a_policy_only_tightens_the_tenants_limits():
    home = _policy(HOME_POLICY % 1000)
    passthrough = _policy((packaged_policy_dir() / "passthrough.yaml").read_text())
    tiny = _policy(TINY_POLICY)
    strict = _policy((packaged_policy_dir() / "rag-strict.yaml").read_text())
    base = QuotaLimits.from_policy(home.quota)
    assert base.tightened_by(quota_cap(home, passthrough)) == base  # no quota: not a loosening
    assert base.tightened_by(quota_cap(home, tiny)) == QuotaLimits(
        tokens_per_minute=1000, requests_per_minute=1
    )
    merged = base.tightened_by(quota_cap(home, strict))  # 20000 tpm, 2M tpd, rpm 120, deny
    assert (merged.tokens_per_minute, merged.tokens_per_day, merged.requests_per_minute) == (
        1000,
        2_000_000,
        120,
    )
    assert merged.on_store_error == "deny"
    # The tenant's own quota (keys file) over its home policy is its base; the home policy does not cap it.
    raised = QuotaLimits.from_policy(home.quota, {"tokens_per_minute": 50_000, "budget": 3.0})
    assert raised.tightened_by(quota_cap(home, home)).tokens_per_minute == 50_000
    # ... but a request override of the home policy's quota may only lower it.
    lowered = home.model_copy(update={"quota": home.quota.model_copy(update={"tokens_per_minute": 10})})
    assert raised.tightened_by(quota_cap(home, lowered)).tokens_per_minute == 10
    higher = home.model_copy(update={"quota": home.quota.model_copy(update={"tokens_per_minute": 10**9})})
    assert raised.tightened_by(quota_cap(home, higher)).tokens_per_minute == 50_000
    assert raised.tightened_by(quota_cap(home, passthrough)).budget == 3.0


def test_a_policy_only_raises_the_tenants_prices():
    home = _policy(HOME_POLICY % 1000).cost
    cheap = _policy("name: cheap\ncost: {prompt_per_1k: 0.1, completion_per_1k: 0.0}\n").cost
    pricey = _policy(PRICEY_POLICY).cost
    euro = _policy("name: euro\ncost: {prompt_per_1k: 9.0, completion_per_1k: 9.0, currency: EUR}\n").cost
    assert tenant_prices(home, cheap) == home
    assert (tenant_prices(home, pricey).prompt_per_1k, tenant_prices(home, pricey).completion_per_1k) == (
        5.0,
        2.0,
    )
    assert tenant_prices(home, euro) == home  # another currency cannot be compared: the tenant's own


@pytest.mark.parametrize("store_kind", ["memory", "redis"])
async def test_the_ledger_is_the_tenants_whatever_the_policy(store_kind, request):
    """One minute (a fixed `now`): spending under the home policy and under passthrough draws on the
    same counters, and passthrough's merged limits are the home's."""
    store = (
        InProcessQuotaStore()
        if store_kind == "memory"
        else RedisQuotaStore(request.getfixturevalue("redis_server").url)
    )
    home = _policy(HOME_POLICY % 100)
    passthrough = _policy((packaged_policy_dir() / "passthrough.yaml").read_text())
    base = QuotaLimits.from_policy(home.quota)
    now = 1_700_000_010.0
    try:
        await store.reserve("acme", base, 60, 0, now)
        with pytest.raises(QuotaExceeded, match="tenant 'acme' is over its tokens_per_minute quota"):
            await store.reserve("acme", base.tightened_by(quota_cap(home, passthrough)), 60, 0, now + 1)
        await store.reserve("acme", base.tightened_by(quota_cap(home, passthrough)), 40, 0, now + 2)
        assert [u.used for u in await store.usage("acme", base, now + 2)] == [100]
        await store.reserve("acme", base, 60, 0, now + 61)  # the sliding minute has room again
    finally:
        await store.close()


# -- in-process -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gateway(engine, files):  # noqa: F811 (the engine fixture)
    from ctxgate.gateway.app import create_app

    settings = GatewaySettings(
        policy_dir=files / "policies", keys_file=files / "keys.yaml", index_dir=files / "indexes"
    )
    app = create_app(settings, engine=engine, clock=FakeClock(START))
    with ServerThread(app) as running:
        running.store = app.state.gateway.store
        yield running


def test_naming_a_looser_policy_does_not_escape_the_quota(gateway, quota_tokens):
    responses = _until_refused([gateway.url], "acme", _chat("passthrough"))
    used = _minute_used(gateway.store, "acme", quota_tokens[1])
    _assert_held_to_quota(responses, used, quota_tokens[1])
    assert responses[0].json()["usage"]["ctxgate"]["policy"] == "passthrough"


def test_a_policy_outside_the_allow_list_is_403(gateway):
    for policy in ("passthrough", "tiny", "no-such-policy"):  # the same answer whether it exists or not
        _assert_policy_refused(_post(gateway.url, "globex", _chat(policy)), policy)
        _assert_policy_refused(_post(gateway.url, "globex", _chat(policy), "/v1/ctxgate/compress"), policy)
    completion = httpx.post(
        f"{gateway.url}/v1/completions",
        timeout=60,
        headers={"authorization": f"Bearer {KEYS['globex']}"},
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "ctxgate": {"policy": "tiny"}},
    )
    _assert_policy_refused(completion, "tiny")
    home = _post(gateway.url, "globex", _chat(HOME), "/v1/ctxgate/compress")
    assert home.status_code == 200 and home.json()["policy"] == HOME


def test_a_stricter_policy_tightens_the_tenants_limits(gateway):
    responses = _until_refused([gateway.url], "initech", _chat("tiny"), "/v1/ctxgate/compress")
    assert [r.status_code for r in responses] == [200, 429]
    assert responses[-1].json()["error"]["code"] == "requests_per_minute"


def test_prices_are_the_tenants_and_a_policy_only_raises_them(gateway):
    for policy, prompt_price, completion_price in (
        ("passthrough", 1.0, 2.0),
        ("pricey", 5.0, 2.0),
        (None, 1.0, 2.0),
    ):
        response = _post(gateway.url, "pricing", _chat(policy))
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        expected = (
            usage["prompt_tokens"] / 1000 * prompt_price
            + usage["completion_tokens"] / 1000 * completion_price
        )
        assert usage["ctxgate"]["cost"] == pytest.approx(expected), policy
    # The tenant's keys-file quota (1M tokens/minute) is its own: its home policy's small one does not cap it.
    statuses = [
        _post(gateway.url, "pricing", _chat(HOME), "/v1/ctxgate/compress").status_code for _ in range(4)
    ]
    assert statuses == [200] * 4


def test_policies_listing_shows_only_the_keys_policies_without_paths(gateway, files):
    listing = httpx.get(
        f"{gateway.url}/v1/ctxgate/policies", timeout=30, headers={"authorization": f"Bearer {KEYS['acme']}"}
    )
    assert listing.status_code == 200
    body = listing.json()
    assert body["default"] == HOME
    assert sorted(p["name"] for p in body["policies"]) == sorted([HOME, "passthrough", "tiny", "pricey"])
    assert "errors" not in body and all("file" not in p for p in body["policies"])
    globex = httpx.get(
        f"{gateway.url}/v1/ctxgate/policies", headers={"authorization": f"Bearer {KEYS['globex']}"}
    )
    assert [p["name"] for p in globex.json()["policies"]] == [HOME]
    for text in (listing.text, globex.text):
        assert str(files) not in text and str(packaged_policy_dir()) not in text and ".yaml" not in text
    assert httpx.get(f"{gateway.url}/v1/ctxgate/policies").status_code == 401


def test_models_listing_and_requests_follow_the_keys_models(gateway):
    listed = httpx.get(f"{gateway.url}/v1/models", headers={"authorization": f"Bearer {KEYS['models']}"})
    assert listed.status_code == 200 and listed.json()["data"] == []  # the key may use only "front"
    everything = httpx.get(f"{gateway.url}/v1/models", headers={"authorization": f"Bearer {KEYS['acme']}"})
    assert [m["id"] for m in everything.json()["data"]] == [MODEL]
    refused = _post(gateway.url, "models", _chat(), "/v1/ctxgate/compress")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"


# -- upstream mode and two replicas on a real Redis -------------------------------------------------
@pytest.fixture(scope="module")
def backend(engine):  # noqa: F811 (the engine fixture)
    """The model behind the gateways under test: an open ctxgate gateway on the real engine."""
    from ctxgate.gateway.app import create_app

    with ServerThread(create_app(GatewaySettings(default_policy="passthrough"), engine=engine)) as running:
        yield running


def test_upstream_mode_holds_the_quota(backend, files, quota_tokens):
    from ctxgate.gateway.app import create_app

    settings = GatewaySettings(
        upstreams=[f"{backend.url}/v1"],
        served_model_name="front",
        policy_dir=files / "policies",
        keys_file=files / "keys.yaml",
    )
    app = create_app(settings, clock=FakeClock(START))
    with ServerThread(app) as front:
        responses = _until_refused([front.url], "acme", _chat("passthrough", model="front"))
        used = _minute_used(app.state.gateway.store, "acme", quota_tokens[1])
        _assert_held_to_quota(responses, used, quota_tokens[1])
        _assert_policy_refused(_post(front.url, "globex", _chat("passthrough", model="front")), "passthrough")


@pytest.fixture(scope="module")
def replicas(backend, files, tmp_path_factory):
    """Two `ctxgate serve` processes in upstream mode sharing one real redis-server."""
    from tests.support.redis import RedisServer

    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    config = files / "ctxgate.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {"served_model_name": "front", "reload_interval": 0.2},
                "upstreams": {"urls": [f"{backend.url}/v1"], "model": MODEL},
                "redis": {"url": redis.url},
                "keys_file": "keys.yaml",
                "policy_dir": "policies",
            }
        )
    )
    env = ctxgate_env()
    env.pop("REDIS_URL", None)
    try:
        with ctxgate_replicas(["--config", str(config)], files, env) as urls:
            yield urls, redis
    finally:
        redis.stop()


def test_two_replicas_on_redis_hold_the_quota(replicas, quota_tokens):
    urls, redis = replicas

    async def usage(tenant: str, minute: int) -> int:
        store = RedisQuotaStore(redis.url)
        try:  # the sliding minute just after the burst: all of it
            (tokens,) = await store.usage(tenant, QuotaLimits(tokens_per_minute=quota_tokens[1]))
            return tokens.used
        finally:
            await store.close()

    def attempt(tenant: str, minute: int) -> tuple[list[httpx.Response], int]:
        responses = _until_refused(urls, tenant, _chat("passthrough", model="front"))
        return responses, asyncio.run(usage(tenant, minute))

    # The replicas read the wall clock: a burst a minute boundary cut through runs again as acme's twin.
    responses, used = in_one_minute(attempt, ["acme", "acme-again"])
    assert {str(r.request.url).split("/v1")[0] for r in responses} == set(urls)  # both replicas served it
    _assert_held_to_quota(responses, used, quota_tokens[1])
    for url in urls:
        _assert_policy_refused(_post(url, "globex", _chat("passthrough", model="front")), "passthrough")


# -- indexes -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def indexed(engine, tmp_path_factory):  # noqa: F811 (the engine fixture)
    from ctxgate.compression.store.index import build_index
    from ctxgate.gateway.app import create_app

    root = tmp_path_factory.mktemp("indexed")
    corpus = root / "corpus.jsonl"
    corpus.write_text(
        json.dumps({"id": "alps", "title": "Alps", "text": "Mont Blanc is the highest Alpine peak."})
    )
    build_index(corpus, "acme-docs", root / "indexes", show_progress=False)
    build_index(corpus, "globex-docs", root / "indexes", show_progress=False)
    keys = root / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "tenants": {
                    "acme": {"indexes": ["acme-docs"], "keys": [{"sha256": hash_key(KEYS["acme"])}]},
                    "globex": {"keys": [{"sha256": hash_key(KEYS["globex"])}]},  # no index at all
                }
            }
        )
    )
    keyed = create_app(GatewaySettings(keys_file=keys, index_dir=root / "indexes"), engine=engine)
    open_app = create_app(GatewaySettings(index_dir=root / "indexes"), engine=engine)
    with ServerThread(keyed) as keyed_server, ServerThread(open_app) as open_server:
        yield keyed_server.url, open_server.url, root


def _retrieve(url: str, index: str, tenant: str | None = None) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Highest Alpine peak?"}],
        "ctxgate": {"retrieval": {"index": index, "top_n": 1}},
    }
    headers = {"authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    return httpx.post(f"{url}/v1/ctxgate/compress", json=body, headers=headers, timeout=60)


def test_an_index_belongs_to_its_tenants(indexed):
    keyed, open_url, root = indexed
    own = _retrieve(keyed, "acme-docs", "acme")
    assert own.status_code == 200 and "Mont Blanc" in json.dumps(own.json()["messages"])
    # Another tenant's index, an index nobody has, and one the tenant may use that is not built:
    # one 404 that does not say which (index names can be secrets of their own).
    for tenant, index in (("acme", "globex-docs"), ("acme", "missing"), ("globex", "acme-docs")):
        refused = _retrieve(keyed, index, tenant)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"] == {
            "message": f"retrieval index '{index}' not found",
            "type": "not_found_error",
            "param": "ctxgate.retrieval.index",
            "code": "index_not_found",
        }
    # Open mode: every index, and the same 404 (without the index directory) for a missing one.
    assert _retrieve(open_url, "globex-docs").status_code == 200
    missing = _retrieve(open_url, "missing")
    assert missing.status_code == 404 and str(root) not in missing.text


@pytest.mark.parametrize(
    "name",
    ["..", ".", ".hidden", "a/b", "a\\b", "a.b", "-lead", "x" * 65, "docs\n", " docs", "\u00e9t\u00e9"],
)
def test_index_names_are_validated(indexed, name):
    keyed, open_url, root = indexed
    for url, tenant in ((keyed, "acme"), (open_url, None)):
        response = _retrieve(url, name, tenant)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_index_name" and error["param"] == "ctxgate.retrieval.index"
        assert str(root) not in response.text and "/indexes" not in response.text


# -- the keys file ---------------------------------------------------------------------------------
_ADD_KEYS = """
import sys
from ctxgate.gateway.key_admin import add_key
path, tenant, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
print(" ".join(add_key(path, tenant, policy="rag-strict", policies=["passthrough"]) for _ in range(count)))
"""


def test_concurrent_key_writers_lose_nothing(tmp_path):
    """Two processes adding keys to one file at once: every key lands (the lock), no temporary file
    stays behind, and the file is valid throughout (the rename)."""
    path = tmp_path / "keys.yaml"
    add_key(path, "seed")
    count = 25
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _ADD_KEYS, str(path), tenant, str(count)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tenant in ("left", "right")
    ]
    readings = 0
    while any(w.poll() is None for w in writers):
        assert isinstance(read_keys_file(path), KeysFile)  # never half a file
        readings += 1
    results = [w.communicate(timeout=60) for w in writers]
    assert all(w.returncode == 0 for w in writers), [err for _, err in results]
    keys_file = read_keys_file(path)
    store = KeyStore(path)
    for tenant, (out, _) in zip(("left", "right"), results, strict=True):
        issued = out.split()
        assert len(issued) == count and len(keys_file.tenants[tenant].keys) == count
        assert all(store.resolve(key).name == tenant for key in issued)
        assert keys_file.tenants[tenant].policies == ["passthrough"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.yaml", "keys.yaml.lock"]
    assert readings > 0


def test_keys_add_sets_the_allow_lists(tmp_path):
    keys = tmp_path / "keys.yaml"

    def add(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ctxgate", "keys", "add", "acme", "--keys", str(keys), *argv],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )

    first = add("--policy", "rag-strict", "--allow-policy", "passthrough", "--allow-index", "acme-docs")
    assert first.returncode == 0, first.stderr
    second = add("--allow-policy", "rag-fast", "--allow-policy", "passthrough")
    assert second.returncode == 0, second.stderr
    tenant = KeyStore(keys).resolve(first.stdout.strip())
    assert tenant.policy == "rag-strict" and tenant.policies == ("passthrough", "rag-fast")
    assert tenant.indexes == ("acme-docs",)
    bad = add("--allow-index", "../etc")
    assert bad.returncode == 2 and "tenants.acme.indexes" in bad.stderr and "Traceback" not in bad.stderr
    assert len(read_keys_file(keys).tenants["acme"].keys) == 2  # the refused add wrote nothing
