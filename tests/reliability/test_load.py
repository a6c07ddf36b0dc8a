"""Short load test: the gateway at about twice its measured capacity sheds load politely and leaks nothing."""

from __future__ import annotations

import asyncio

import pytest

from ctxgate.gateway.app import create_app
from tests.reliability.conftest import gateway_settings
from tests.reliability.loadgen import measure_capacity, rss_bytes, run_load
from tests.support.servers import ServerThread
from tests.support.waiting import eventually, wait_until_engine_idle

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def loaded_gateway(small_engine, tmp_path_factory):
    settings = gateway_settings(tmp_path_factory.mktemp("load"), max_queued=2, queue_timeout_s=1.0)
    app = create_app(settings, engine=small_engine)
    with ServerThread(app) as running:
        running.app = app
        yield running


# Its overload and memory figures depend on how busy the 2 shared cores are (capacity is measured
# first, then driven at twice that): once in about five full-suite runs it failed and a rerun passed.
# One rerun keeps CI honest without hiding a real leak, which fails both times.
@pytest.mark.flaky(reruns=1)
def test_twice_capacity_sheds_load_and_leaks_nothing(loaded_gateway, small_engine):
    url = loaded_gateway.url
    admission = loaded_gateway.app.state.admission
    capacity = asyncio.run(measure_capacity(url, concurrency=4, num_requests=8, max_tokens=8))
    # Second warm-up round at load so allocator caches and pools reach their steady size.
    asyncio.run(run_load(url, rate_per_s=2 * capacity, max_requests=12, duration_s=10, seed=1))
    wait_until_engine_idle(small_engine)
    rss_start = rss_bytes()

    report = asyncio.run(run_load(url, rate_per_s=2 * capacity, max_requests=60, duration_s=25, seed=2))
    print(f"capacity {capacity:.2f} req/s; load figures {report.figures()}")

    assert report.problems == [], report.problems
    assert report.errors_5xx == 0 and report.hung == 0
    assert report.rejected_503 + report.rejected_429 > 0, "2x capacity must reach the overload answer"
    assert report.completed > 0
    assert report.accepted == report.completed + report.aborted
    assert report.sent == report.accepted + report.rejected_503 + report.rejected_429
    # Everything accepted has finished or been aborted: no request left running, every KV block free.
    wait_until_engine_idle(small_engine, timeout_s=30)
    # Handlers may still be writing their last bytes.
    eventually(
        lambda: admission.in_flight == 0, timeout_s=20, interval_s=0.1, message=lambda: str(admission.stats())
    )
    assert admission.stats().queued == 0, admission.stats()
    stats = small_engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    assert small_engine.engine.sequences == {}  # no finished or aborted request left behind
    growth = rss_bytes() - rss_start
    assert growth < 150 * 1024 * 1024, f"RSS grew {growth / 2**20:.0f} MiB under load"
