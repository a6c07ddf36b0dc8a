"""Faults while serving: KV pool exhausted, policy file corrupted, upstream killed, Redis killed mid-load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from ctxgate.backend.engine.api import GenerationRequest, Priority, SamplingParams
from ctxgate.gateway.app import create_app
from tests.reliability.conftest import MODEL_NAME, RELIABILITY_POLICY, chat_body, gateway_settings
from tests.reliability.loadgen import run_load
from tests.support.redis import RedisServer
from tests.support.servers import ServerThread, free_port, wait_http, write_policy
from tests.support.waiting import eventually, wait_until_engine_idle

pytestmark = pytest.mark.timeout(300)


# -- the engine out of KV blocks ------------------------------------------------------------------
async def _generate_all(engine, requests):
    async def one(request):
        deltas = [delta async for delta in engine.generate(request)]
        return deltas[-1], sum(len(d.token_ids) for d in deltas)

    return await asyncio.gather(*(one(r) for r in requests))


def test_engine_out_of_kv_blocks_preempts_instead_of_failing(small_engine, tokenizer):
    # Four sequences of ~30 prompt + 80 output tokens need ~28 blocks; the pool has 24.
    stats_before = small_engine.stats()
    requests = [
        GenerationRequest(
            request_id=f"kv-{i}",
            priority=Priority.BACKGROUND if i % 2 else Priority.USER,
            prompt_token_ids=tokenizer.encode_chat(
                [{"role": "user", "content": f"Tell story number {i} " * 3}]
            ),
            sampling=SamplingParams(max_tokens=80, temperature=0, ignore_eos=True),
        )
        for i in range(4)
    ]
    needed = sum(-(-(len(r.prompt_token_ids) + 80) // 16) for r in requests)
    assert needed > stats_before.num_kv_blocks_total
    results = asyncio.run(_generate_all(small_engine, requests))
    for final, num_tokens in results:
        assert final.finish_reason == "length"
        assert num_tokens == final.completion_tokens == 80
    stats = small_engine.stats()
    assert stats.num_preemptions > stats_before.num_preemptions
    assert sum(final.metrics.preemptions for final, _ in results) > 0
    wait_until_engine_idle(small_engine)


# -- a policy file corrupted while serving --------------------------------------------------------
def test_policy_corrupted_while_serving_keeps_old_policy(small_engine, tmp_path):
    settings = gateway_settings(
        tmp_path, reload_interval_s=0.2, max_in_flight=4, max_queued=16, queue_timeout_s=60
    )
    policy_dir = settings.policy_dir
    with ServerThread(create_app(settings, engine=small_engine)) as server:

        async def load_while_corrupting():
            load = asyncio.create_task(
                run_load(
                    server.url, rate_per_s=4, max_requests=16, duration_s=8, seed=5, disconnect_fraction=0.0
                )
            )
            await asyncio.sleep(0.5)
            for garbage in (
                "name: rel\nmax_input_tokens: [unclosed\n",
                "name: rel\nmax_input_tokens: -5\n",
                "\x00\xff binary junk",
                "",
            ):
                write_policy(policy_dir, "rel", garbage)
                await asyncio.sleep(0.6)
            return await load

        report = asyncio.run(load_while_corrupting())
        assert report.problems == [] and report.completed == report.sent, report.figures()
        listing = httpx.get(f"{server.url}/v1/ctxgate/policies").json()
        assert [p["name"] for p in listing["policies"]] == ["rel"]
        assert listing["policies"][0]["effective"]["max_input_tokens"] == 256  # the last good version
        assert listing["last_reload_error"] and "rel.yaml" in listing["last_reload_error"]["file"]
        # Repaired file: applies again.
        write_policy(
            policy_dir, "rel", RELIABILITY_POLICY.replace("max_input_tokens: 256", "max_input_tokens: 200")
        )
        eventually(
            lambda: (
                httpx.get(f"{server.url}/v1/ctxgate/policies").json()["policies"][0]["effective"][
                    "max_input_tokens"
                ]
                == 200
            ),
            timeout_s=10,
            interval_s=0.2,
            message="repaired policy not reloaded",
        )
    wait_until_engine_idle(small_engine)


# -- an upstream engine process killed mid-stream -------------------------------------------------
@pytest.fixture
def upstream_process(tmp_path):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ctxgate",
            "engine",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "1024",
            "--threads",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout_s=180)
        yield f"http://127.0.0.1:{port}", process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def test_upstream_killed_mid_stream_gives_a_clean_error_event(upstream_process, tmp_path):
    upstream_url, process = upstream_process
    settings = gateway_settings(
        tmp_path,
        upstreams=[f"{upstream_url}/v1"],
        upstream_read_timeout_s=10,
        upstream_retries=0,
        upstream_connect_timeout_s=1,
        request_timeout_s=30,
        served_model_name=MODEL_NAME,
    )
    slow = RELIABILITY_POLICY.replace("reserve_output_tokens: 8", "reserve_output_tokens: 400")
    write_policy(settings.policy_dir, "rel", slow)
    with ServerThread(create_app(settings)) as server:
        body = chat_body("Count from one to a thousand.", max_tokens=400) | {
            "stream": True,
            "ignore_eos": True,
        }
        events: list[str] = []
        started = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: ") :])
                if len(events) == 3:  # mid-stream: tokens are flowing
                    process.send_signal(signal.SIGKILL)
        elapsed = time.monotonic() - started
        assert elapsed < 30, f"the stream hung for {elapsed:.0f}s after the upstream died"
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] in ("upstream_error", "engine_error", "timeout"), error
        assert error["message"]
        # No final "stop" chunk pretending the answer was complete.
        finishes = [c.get("finish_reason") for e in events[:-2] for c in json.loads(e).get("choices", [])]
        assert not any(finishes), finishes
        # New requests get a prompt, clear JSON error, not a hang.
        started = time.monotonic()
        after = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=2), timeout=30)
        assert after.status_code in (502, 503), after.text
        assert after.json()["error"]["message"]
        assert time.monotonic() - started < 15


# -- Redis killed and restarted while generation requests run --------------------------------------
def test_redis_killed_mid_load_then_recovers(small_engine, tmp_path):
    redis_server = RedisServer(tmp_path)
    redis_server.start()
    quota = "quota: {tokens_per_minute: 1000000, requests_per_minute: 100000, on_store_error: allow}\n"
    settings = gateway_settings(
        tmp_path, redis_url=redis_server.url, max_in_flight=4, max_queued=32, queue_timeout_s=60
    )
    write_policy(settings.policy_dir, "rel", RELIABILITY_POLICY + quota)
    try:
        with ServerThread(create_app(settings, engine=small_engine)) as server:
            assert httpx.get(f"{server.url}/ready").json()["store"] is True

            async def load_with_outage():
                load = asyncio.create_task(
                    run_load(
                        server.url,
                        rate_per_s=4,
                        max_requests=24,
                        duration_s=10,
                        seed=9,
                        disconnect_fraction=0.1,
                    )
                )
                await asyncio.sleep(1.5)
                redis_server.stop()  # reservations and reconciles in flight now fail
                await asyncio.sleep(2.0)
                await asyncio.to_thread(redis_server.start)  # same port, empty data
                return await load

            report = asyncio.run(load_with_outage())
            # on_store_error: allow -> every request is served through the outage, none fails.
            assert report.problems == [] and report.errors_5xx == 0, report.figures()
            assert report.completed + report.aborted == report.sent
            eventually(
                lambda: httpx.get(f"{server.url}/ready").status_code == 200,
                timeout_s=10,
                interval_s=0.2,
                message="store did not come back",
            )
            metrics = httpx.get(f"{server.url}/metrics").text
            assert 'ctxgate:quota_store_errors_total{action="allow"}' in metrics
            ok = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=2), timeout=60)
            assert ok.status_code == 200
            import redis

            keys = redis.Redis.from_url(redis_server.url).keys("ctxgate:quota:*")
            assert keys, "the ledger is written to Redis again after recovery"
    finally:
        redis_server.stop()
    wait_until_engine_idle(small_engine)
