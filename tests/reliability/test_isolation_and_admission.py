"""Tenant isolation end to end, and the gateway's admission control (bounded queue, 503, timeouts)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from ctxgate.gateway.admission import AdmissionController, Overloaded
from ctxgate.gateway.app import create_app
from ctxgate.gateway.key_admin import add_key
from tests.reliability.conftest import chat_body, gateway_settings
from tests.support.servers import ServerThread
from tests.support.waiting import wait_until_engine_idle

pytestmark = pytest.mark.timeout(300)

# Long enough to fill several 16-token KV blocks, so a prefix-cache hit is visible.
SHARED_PROMPT = (
    "The quarterly report of the northern warehouse lists pallets, forklifts, shelving units, "
    "loading docks and the inventory counts for every aisle in detail. "
) * 3


@pytest.fixture(scope="module")
def tenants_gateway(small_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    keys_file = root / "keys.yaml"
    keys = {name: add_key(keys_file, name) for name in ("alpha", "beta")}
    settings = gateway_settings(root, keys_file=keys_file)
    with ServerThread(create_app(settings, engine=small_engine)) as running:
        running.keys = keys
        yield running


def _cached_tokens(server, tenant: str, content: str) -> int:
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json=chat_body(content, max_tokens=1),
        timeout=120,
        headers={"authorization": f"Bearer {server.keys[tenant]}"},
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["ctxgate"]["tenant"] == tenant
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_prefix_cache_never_crosses_tenants(tenants_gateway, small_engine):
    prompt = f"{time.time_ns()} {SHARED_PROMPT}"  # fresh text: nothing cached from earlier tests
    assert _cached_tokens(tenants_gateway, "alpha", prompt) == 0
    assert _cached_tokens(tenants_gateway, "alpha", prompt) >= 32  # same tenant: the prefix is reused
    assert _cached_tokens(tenants_gateway, "beta", prompt) == 0  # other tenant: a miss, never a hit
    assert _cached_tokens(tenants_gateway, "beta", prompt) >= 32  # its own cache works
    wait_until_engine_idle(small_engine)


def test_history_summaries_are_keyed_per_tenant():
    from ctxgate.compression.history import turns_key

    turns = [
        {"role": "user", "content": "my account number is 12345"},
        {"role": "assistant", "content": "noted"},
    ]
    assert turns_key("alpha", turns) != turns_key("beta", turns)
    assert turns_key("alpha", turns) == turns_key("alpha", [dict(t) for t in turns])
    assert "12345" not in turns_key("alpha", turns)  # the key itself holds no tenant text


def test_keys_are_stored_hashed(tmp_path):
    from ctxgate.gateway.keys import hash_key

    keys_file = tmp_path / "keys.yaml"
    key = add_key(keys_file, "gamma")
    stored = keys_file.read_text()
    assert key not in stored and hash_key(key) in stored


# -- admission control ----------------------------------------------------------------------------
async def test_controller_bounds_in_flight_and_queue_in_fifo_order():
    controller = AdmissionController(max_in_flight=2, max_queued=2, queue_timeout_s=5)
    await controller.acquire()
    await controller.acquire()
    order: list[int] = []

    async def queued(index: int) -> None:
        await controller.acquire()
        order.append(index)

    waiters = [asyncio.create_task(queued(i)) for i in range(2)]
    await asyncio.sleep(0.01)
    assert controller.stats().queued == 2
    with pytest.raises(Overloaded):  # queue full: refused at once
        await controller.acquire()
    controller.release()
    controller.release()
    await asyncio.gather(*waiters)
    assert order == [0, 1] and controller.in_flight == 2
    controller.release()
    controller.release()
    assert controller.in_flight == 0 and controller.rejected == 1


async def test_controller_queue_timeout_and_draining():
    controller = AdmissionController(max_in_flight=1, max_queued=4, queue_timeout_s=0.1)
    await controller.acquire()
    with pytest.raises(Overloaded, match="no capacity"):
        await controller.acquire()
    assert controller.stats().queued == 0
    waiter = asyncio.create_task(controller.acquire())
    await asyncio.sleep(0.01)
    controller.start_draining()
    with pytest.raises(Overloaded, match="shutting down"):
        await waiter
    with pytest.raises(Overloaded, match="shutting down"):
        await controller.acquire()
    controller.release()
    assert controller.in_flight == 0


def test_gateway_overload_answer_is_503_with_retry_after(small_engine, tmp_path):
    settings = gateway_settings(tmp_path, max_in_flight=1, max_queued=1, queue_timeout_s=30)
    with ServerThread(create_app(settings, engine=small_engine)) as server:

        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                body = chat_body(max_tokens=8) | {"ignore_eos": True}
                return await asyncio.gather(
                    *(client.post(f"{server.url}/v1/chat/completions", json=body) for _ in range(6))
                )

        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert statuses.count(200) >= 2 and statuses.count(503) >= 1, statuses
        assert set(statuses) <= {200, 503}
        for response in responses:
            if response.status_code == 503:
                assert int(response.headers["retry-after"]) >= 1
                assert response.json()["error"]["code"] == "overloaded"
        # Health and metrics are never queued behind generation.
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert 'status="503"' in httpx.get(f"{server.url}/metrics", timeout=5).text
    wait_until_engine_idle(small_engine)


def test_request_timeout_is_a_clean_504_and_frees_the_engine(small_engine, tmp_path):
    settings = gateway_settings(tmp_path, request_timeout_s=0.3)
    slow = chat_body("Write a long story.", max_tokens=8) | {"ignore_eos": True}
    write_policy_text = (
        (settings.policy_dir / "rel.yaml")
        .read_text()
        .replace("reserve_output_tokens: 8", "reserve_output_tokens: 300")
    )
    (settings.policy_dir / "rel.yaml").write_text(write_policy_text)
    with ServerThread(create_app(settings, engine=small_engine)) as server:
        slow["max_tokens"] = 300
        started = time.monotonic()
        response = httpx.post(f"{server.url}/v1/chat/completions", json=slow, timeout=60)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "timeout"
        assert time.monotonic() - started < 10
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json=slow | {"stream": True}, timeout=60
        ) as stream:
            status = stream.status_code
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        if status != 504:  # 504: timed out before the first token, still an HTTP status
            assert status == 200 and lines[-1] == "data: [DONE]"
            assert '"timeout"' in lines[-2]  # timed out mid-stream: a clean in-band error event
    wait_until_engine_idle(small_engine, timeout_s=30)
