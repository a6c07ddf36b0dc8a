"""Shadow comparisons through a real gateway on the real model, with a real Redis quota ledger:
every sampled request on an idle engine is compared (in /metrics, /v1/ctxgate/shadow and the shadow
log), no tenant sees another's entries, shadow tokens never reach a tenant's quota or spend, and on
a busy engine shadow work is dropped with its reason."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from ctxgate.gateway.app import create_app
from ctxgate.gateway.keys import hash_key
from ctxgate.gateway.settings import GatewaySettings
from tests.support.redis import RedisServer
from tests.support.servers import ServerThread, write_policy
from tests.support.waiting import eventually, wait_until_engine_idle
from tests.town_facts import TOWN_FACTS, TOWN_QUESTION

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"acme": "sk-acme-shadow-0123456789", "globex": "sk-globex-shadow-0123456789"}
# Cheap compression (no embedding model): the best two passages by BM25, cut to the budget.
CHEAP = (
    "rerank: {method: bm25, top_k: 2}\ndedup: {near_duplicate_cosine: null}\nextraction: {enabled: false}\n"
)
SHADOWED = (
    "name: shadowed\nmax_input_tokens: 1024\nreserve_output_tokens: 16\ndocuments: {max_tokens: 80}\n"
    f"{CHEAP}cost: {{prompt_per_1k: 1.0, completion_per_1k: 1.0}}\n"
    "quota: {tokens_per_minute: 100000, spend_per_day: 100}\n"
    "shadow: {sample_rate: 1, max_kv_usage: 1.0}\n"
)


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shadow")
    (root / "policies").mkdir()
    write_policy(root / "policies", "shadowed", SHADOWED)
    tenants = {
        name: {"policy": "shadowed", "keys": [{"sha256": hash_key(secret)}]} for name, secret in KEYS.items()
    }
    (root / "keys.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    return root


@pytest.fixture(scope="module")
def gateway(engine, files, redis):
    settings = GatewaySettings(
        policy_dir=files / "policies",
        keys_file=files / "keys.yaml",
        redis_url=redis.url,
        shadow_log=files / "shadow.jsonl",
    )
    app = create_app(settings, engine=engine)
    with ServerThread(app) as running:
        running.app = app
        yield running


def _chat(question: str = TOWN_QUESTION, max_tokens: int = 8, **extra) -> dict:
    documents = [{"title": name, "text": text} for name, text in TOWN_FACTS]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ctxgate": {"documents": documents},
    } | extra


def _post(server, tenant: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def _summary(server, tenant: str) -> dict:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    response = httpx.get(f"{server.url}/v1/ctxgate/shadow", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _comparisons(server, tenant: str) -> int:
    return sum(item["comparisons"] for item in _summary(server, tenant)["policies"])


def _shadows_done(server) -> None:
    runner = server.app.state.gateway.shadow
    eventually(lambda: runner.in_flight == 0, timeout_s=120, message="shadow requests still running")


def _metric(server, pattern: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    values = [float(m.group(1)) for m in re.finditer(pattern + r" ([0-9.e+-]+)$", text, re.MULTILINE)]
    return sum(values)


def test_every_request_on_an_idle_engine_is_compared_and_tenants_see_only_their_own(gateway, files):
    answered = []
    for question in (TOWN_QUESTION, "Which river does Brisk lie on?"):
        response = _post(gateway, "acme", _chat(question))
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["ctxgate"]["prompt_tokens"] < usage["ctxgate"]["original_prompt_tokens"]
        answered.append(response.json()["id"])
        _shadows_done(gateway)  # an idle engine between requests: each one's shadow runs
    acme = _summary(gateway, "acme")
    [policy] = acme["policies"]
    assert policy["policy"] == "shadowed" and policy["comparisons"] == 2
    assert policy["sampled"] == 2  # every request drawn at sample_rate 1, each one compared
    assert 0.0 <= policy["mean_agreement"] <= 1.0
    assert policy["dropped"] == {}
    for entry in acme["recent_disagreements"]:
        assert entry["tenant"] == "acme" and entry["request_id"] in answered
        assert entry["prompt_tokens_shadow"] > entry["prompt_tokens_live"]
    assert _summary(gateway, "globex")["policies"] == []  # nothing of acme's

    response = _post(gateway, "globex", _chat())
    assert response.status_code == 200
    _shadows_done(gateway)
    assert _comparisons(gateway, "globex") == 1 and _comparisons(gateway, "acme") == 2
    assert all(entry["tenant"] == "globex" for entry in _summary(gateway, "globex")["recent_disagreements"])

    agreement = (
        r'ctxgate:shadow_agreement_count\{comparison="token_f1",model="[^"]+",policy="shadowed",tenant="%s"\}'
    )
    assert _metric(gateway, agreement % "acme") == 2 and _metric(gateway, agreement % "globex") == 1
    assert _metric(gateway, r'ctxgate:shadow_prompt_tokens_total\{policy="shadowed"\}') > 0
    assert _metric(gateway, r'ctxgate:shadow_alert_threshold\{policy="shadowed"\}') == 0.8

    lines = [json.loads(line) for line in (files / "shadow.jsonl").read_text().splitlines()]
    assert [line["request_id"] for line in lines] == [*answered, response.json()["id"]]
    for line in lines:
        assert (
            re.fullmatch(r"[0-9a-f]{64}", line["prompt_hash_live"])
            and line["prompt_hash_shadow"] != line["prompt_hash_live"]
        )
        assert set(line["measures"]) == {"exact", "token_f1", "key_spans", "json_fields"}


def test_shadow_tokens_never_reach_the_tenants_quota_or_spend(gateway, redis):
    from ctxgate.gateway.quota import QuotaLimits
    from ctxgate.gateway.quota.redis_store import RedisQuotaStore

    limits = QuotaLimits(tokens_per_minute=100000, spend_per_day=100)  # the policy's quota

    def usage() -> dict[str, int]:
        async def read() -> dict[str, int]:
            store = RedisQuotaStore(redis.url)
            try:
                return {limit.name: limit.used for limit in await store.usage("acme", limits)}
            finally:
                await store.close()

        return asyncio.run(read())

    _shadows_done(gateway)
    before = usage()
    shadow_tokens = _metric(gateway, r'ctxgate:shadow_prompt_tokens_total\{policy="shadowed"\}')
    response = _post(gateway, "acme", _chat("Who is the mayor of Dovel?"))
    assert response.status_code == 200
    billed = usage()
    _shadows_done(gateway)
    assert _metric(gateway, r'ctxgate:shadow_prompt_tokens_total\{policy="shadowed"\}') > shadow_tokens
    assert usage() == billed  # the shadow request ran and charged nothing
    live = response.json()["usage"]
    changed = {name: billed[name] - before[name] for name in billed if billed[name] != before[name]}
    assert live["total_tokens"] in changed.values()  # the live request was charged: its own tokens only


# -- a busy engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_engine(model_dir):
    """Two sequences at most and every waiting request "at risk" of its TTFT target: real work always
    needs the room a shadow request holds."""
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig

    engine = AsyncEngine(
        EngineConfig(
            model=str(model_dir),
            kv_cache_memory_mb=32,
            max_model_len=2048,
            max_num_seqs=2,
            ttft_target_ms=0.001,
        )
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def busy_gateway(small_engine, tmp_path_factory):
    directory = tmp_path_factory.mktemp("busy")
    base = f"max_input_tokens: 1024\nreserve_output_tokens: 160\ndocuments: {{max_tokens: 80}}\n{CHEAP}"
    write_policy(
        directory, "strict", f"name: strict\n{base}shadow: {{sample_rate: 1, max_kv_usage: 0.001}}\n"
    )
    write_policy(
        directory,
        "long",
        f"name: long\n{base}shadow: {{sample_rate: 1, max_kv_usage: 1.0, output_tokens: 150}}\n",
    )
    write_policy(directory, "plain", f"name: plain\n{base}")
    app = create_app(GatewaySettings(policy_dir=directory), engine=small_engine)
    with ServerThread(app) as running:
        running.app = app
        yield running


def _open_post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def _in_background(server, body: dict) -> tuple[threading.Thread, list[httpx.Response]]:
    responses: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: responses.append(_open_post(server, body)))
    thread.start()
    return thread, responses


def _dropped(server, policy: str, reason: str) -> float:
    return _metric(server, rf'ctxgate:shadow_dropped_total\{{policy="{policy}",reason="{reason}"\}}')


def test_a_request_answered_while_the_engine_is_busy_is_not_shadowed(busy_gateway, small_engine):
    long = _chat(max_tokens=120, ignore_eos=True)
    long["ctxgate"]["policy"] = "plain"
    thread, responses = _in_background(busy_gateway, long)
    eventually(lambda: small_engine.stats().num_running == 1, timeout_s=60)
    short = _chat(max_tokens=2)
    short["ctxgate"]["policy"] = "strict"
    response = _open_post(busy_gateway, short)  # answered while the long one holds KV blocks
    assert response.status_code == 200
    thread.join()
    assert responses[0].status_code == 200
    assert _dropped(busy_gateway, "strict", "busy") == 1
    assert _summary_open(busy_gateway)["policies"][0]["dropped"] == {"busy": 1}
    wait_until_engine_idle(small_engine)


def test_shadow_work_is_dropped_when_real_work_arrives(busy_gateway, small_engine):
    sampled = _chat(max_tokens=2, ignore_eos=True)  # the shadow copies ignore_eos: 150 tokens
    sampled["ctxgate"]["policy"] = "long"
    assert _open_post(busy_gateway, sampled).status_code == 200
    runner = busy_gateway.app.state.gateway.shadow
    eventually(lambda: runner.in_flight == 1 and small_engine.stats().num_running == 1, timeout_s=60)
    real = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    real["ctxgate"] = {"policy": "plain"}
    response = _open_post(busy_gateway, real)
    assert response.status_code == 200
    eventually(lambda: runner.in_flight == 0, timeout_s=60)
    assert _dropped(busy_gateway, "long", "preempted") == 1
    # The drop explains the sampled request: sampled = compared + dropped.
    assert _metric(busy_gateway, r'ctxgate:shadow_sampled_total\{policy="long"\}') == 1
    assert _metric(busy_gateway, r'ctxgate:shadow_prompt_tokens_total\{policy="long"\}') == 0
    wait_until_engine_idle(small_engine)


def _summary_open(server) -> dict:
    return httpx.get(f"{server.url}/v1/ctxgate/shadow", timeout=30).json()


# -- upstream mode -----------------------------------------------------------------------------------

METRICS_KEY = "metrics-secret-0123456789"


@pytest.fixture(scope="module")
def upstream_policies(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("upstream")
    write_policy(directory, "sampled", SHADOWED.replace("name: shadowed", "name: sampled"))
    fixed = SHADOWED.replace("name: shadowed", "name: fixed").replace(
        "sample_rate: 1,", "sample_rate: 0, upstream_fixed_rate: 1,"
    )
    write_policy(directory, "fixed", fixed)
    return directory


@pytest.fixture(scope="module")
def backend(engine):
    """Another gateway on the real model, whose /metrics (with its queue) needs the metrics key."""
    settings = GatewaySettings(default_policy="passthrough", metrics_key=METRICS_KEY)
    with ServerThread(create_app(settings, engine=engine)) as running:
        yield running


def _front(backend, policies: Path, api_key: str | None) -> ServerThread:
    settings = GatewaySettings(upstreams=[f"{backend.url}/v1"], policy_dir=policies, upstream_api_key=api_key)
    app = create_app(settings)
    running = ServerThread(app)
    running.app = app
    return running


def _sampled(front, policy: str) -> None:
    body = _chat(max_tokens=4)
    body["ctxgate"]["policy"] = policy
    response = _open_post(front, body)
    assert response.status_code == 200, response.text
    _shadows_done(front)


def test_an_upstream_whose_load_cannot_be_read_is_shadowed_at_the_fixed_rate_only(backend, upstream_policies):
    with _front(backend, upstream_policies, api_key=None) as front:  # its /metrics answers 401
        _sampled(front, "sampled")
        _sampled(front, "fixed")
        by_policy = {item["policy"]: item for item in _summary_open(front)["policies"]}
    assert by_policy["sampled"]["comparisons"] == 0
    assert by_policy["sampled"]["dropped"] == {"load_unknown": 1}
    assert by_policy["sampled"]["sampled"] == 1 and by_policy["fixed"]["sampled"] == 1
    assert by_policy["fixed"]["comparisons"] == 1 and by_policy["fixed"]["dropped"] == {}


def test_an_upstream_that_reports_its_queue_follows_the_idle_rule(backend, upstream_policies):
    with _front(backend, upstream_policies, api_key=METRICS_KEY) as front:
        load = front.app.state.gateway.shadow.load
        _sampled(front, "sampled")  # the first sampled request starts reading the upstream's load
        eventually(
            lambda: load.reading is not None, timeout_s=30, message="the upstream's load was never read"
        )
        _sampled(front, "sampled")
        by_policy = {item["policy"]: item for item in _summary_open(front)["policies"]}
    assert by_policy["sampled"]["comparisons"] == 1
    assert by_policy["sampled"]["dropped"] == {"load_unknown": 1}
