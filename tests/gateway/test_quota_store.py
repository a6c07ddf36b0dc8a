"""Quota stores: the in-process ledger and the Redis ledger (real redis-server) behave the same."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from ctxgate.gateway.quota import (
    DEFAULT_SLOT_TTL_S,
    InProcessQuotaStore,
    QuotaExceeded,
    QuotaLimits,
    RedisQuotaStore,
    StoreUnavailable,
    create_store,
)
from tests.gateway.clock import FakeClock

NOW = 1_699_999_990.0  # 10 s into a minute (and an hour, and a day is far)


async def used(store, tenant: str, limits: QuotaLimits, now: float | None = None) -> dict[str, int]:
    """The tenant's own limits, by name: what each has used."""
    return {u.name: u.used for u in await store.usage(tenant, limits, now) if u.owner == "tenant"}


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        yield InProcessQuotaStore()
        return
    server = request.getfixturevalue("redis_server")
    redis_store = RedisQuotaStore(server.url)
    yield redis_store
    await redis_store.close()


async def test_tokens_per_minute_reserve_and_reconcile(store):
    limits = QuotaLimits(tokens_per_minute=100, requests_per_minute=10, window="fixed")
    first = await store.reserve("t", limits, 60, 0, now=NOW)
    with pytest.raises(QuotaExceeded) as info:
        await store.reserve("t", limits, 60, 0, now=NOW + 1)
    assert info.value.reason == "tokens_per_minute"
    assert info.value.retry_after_s == 49
    await store.reconcile(first, 30, 0)  # the request used less than it reserved
    await store.reserve("t", limits, 60, 0, now=NOW + 2)
    usage = await used(store, "t", limits, now=NOW + 2)
    assert usage["tokens_per_minute"] == 90 and usage["requests_per_minute"] == 2
    await store.reserve("t", limits, 100, 0, now=NOW + 60)  # the next minute starts empty


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_without_a_time_the_store_reads_its_clock(kind, request):
    clock = FakeClock(NOW)
    store = create_store(
        request.getfixturevalue("redis_server").url if kind == "redis" else None, clock=clock
    )
    limits = QuotaLimits(tokens_per_minute=100, max_parallel_requests=1, window="fixed")
    await store.reserve("t", limits, 60, 0, slot_id="r1")
    clock.advance(5)
    with pytest.raises(QuotaExceeded) as info:
        await store.reserve("t", limits, 60, 0)
    assert (info.value.reason, info.value.retry_after_s) == ("tokens_per_minute", 45)
    assert (await used(store, "t", limits))["tokens_per_minute"] == 60
    clock.advance(DEFAULT_SLOT_TTL_S)  # a later minute, and r1's slot (never settled) has expired
    assert (await used(store, "t", limits))["tokens_per_minute"] == 0
    await store.reserve("t", limits, 100, 0, slot_id="r2")
    await store.close()


async def test_requests_per_minute_and_day_and_spend(store):
    limits = QuotaLimits(requests_per_minute=2, tokens_per_day=1000, spend_per_day=0.01, window="fixed")
    await store.reserve("a", limits, 10, 4000, now=NOW)
    await store.reserve("a", limits, 10, 4000, now=NOW)
    with pytest.raises(QuotaExceeded) as info:
        await store.reserve("a", limits, 10, 0, now=NOW)
    assert info.value.reason == "requests_per_minute"
    with pytest.raises(QuotaExceeded) as info:
        await store.reserve("a", limits, 10, 4000, now=NOW + 60)
    assert info.value.reason == "spend_per_day" and info.value.retry_after_s > 3600
    await store.reserve("b", limits, 10, 4000, now=NOW)  # tenants are independent
    with pytest.raises(QuotaExceeded, match="alone needs"):
        await store.reserve("c", limits, 5000, 0, now=NOW)


async def test_rejected_reservation_changes_nothing(store):
    limits = QuotaLimits(requests_per_minute=10, tokens_per_minute=50)
    await store.reserve("t", limits, 40, 0, now=NOW)
    with pytest.raises(QuotaExceeded):
        await store.reserve("t", limits, 20, 0, now=NOW)
    assert await used(store, "t", limits, now=NOW) == {"requests_per_minute": 1, "tokens_per_minute": 40}


async def test_redis_reservations_are_atomic_across_clients(redis_server):
    stores = [RedisQuotaStore(redis_server.url) for _ in range(4)]
    limits = QuotaLimits(tokens_per_minute=1000)

    async def attempt(store):
        try:
            await store.reserve("shared", limits, 30, 0, now=NOW)
            return 1
        except QuotaExceeded:
            return 0

    admitted = sum(await asyncio.gather(*(attempt(stores[i % 4]) for i in range(200))))
    assert admitted == 1000 // 30
    assert (await used(stores[0], "shared", limits, now=NOW))["tokens_per_minute"] == admitted * 30
    for store in stores:
        await store.close()


async def test_redis_down_raises_store_unavailable_then_recovers(redis_server):
    store = RedisQuotaStore(redis_server.url)
    limits = QuotaLimits(tokens_per_minute=100)
    await store.reserve("t", limits, 10, 0, now=NOW)
    redis_server.stop()
    with pytest.raises(StoreUnavailable):
        await store.reserve("t", limits, 10, 0, now=NOW)
    assert not await store.ping()
    redis_server.start()
    await store.reserve("t", limits, 10, 0, now=NOW)
    assert await store.ping()
    await store.close()


async def test_key_limits_apply_on_top_of_the_tenants(store):
    tenant = QuotaLimits(tokens_per_minute=1000)
    key = QuotaLimits(requests_per_minute=2)
    for _ in range(2):
        await store.reserve("t", tenant, 10, 0, now=NOW, key_id="aaaaaaaaaaaa", key_limits=key)
    with pytest.raises(QuotaExceeded, match="API key 'aaaaaaaaaaaa' is over its requests_per_minute") as info:
        await store.reserve("t", tenant, 10, 0, now=NOW, key_id="aaaaaaaaaaaa", key_limits=key)
    assert info.value.retry_after_s == 61  # sliding: second 0 leaves the window at 61
    # Another key of the same tenant has its own counter but shares the tenant's.
    await store.reserve("t", tenant, 10, 0, now=NOW, key_id="bbbbbbbbbbbb", key_limits=key)
    assert (await used(store, "t", tenant, now=NOW))[
        "tokens_per_minute"
    ] == 30  # the refused one added nothing
    with pytest.raises(QuotaExceeded, match="tenant 't' is over its tokens_per_minute"):
        await store.reserve("t", tenant, 980, 0, now=NOW, key_id="bbbbbbbbbbbb", key_limits=key)


async def test_parallel_slots_are_held_released_and_expire(store):
    limits = QuotaLimits(max_parallel_requests=2)
    first = await store.reserve("p", limits, 1, 0, now=NOW, slot_id="r1")
    await store.reserve("p", limits, 1, 0, now=NOW, slot_id="r2")
    with pytest.raises(QuotaExceeded, match="already has 2 requests in flight") as info:
        await store.reserve("p", limits, 1, 0, now=NOW, slot_id="r3")
    assert info.value.reason == "max_parallel_requests" and info.value.retry_after_s == 1
    with pytest.raises(QuotaExceeded):  # a check-only request (compression) is refused too
        await store.reserve("p", limits, 1, 0, now=NOW)
    await store.reconcile(first, 1, 0)
    await store.reconcile(first, 1, 0)  # twice is still one release
    await store.reserve("p", limits, 1, 0, now=NOW)  # checked, not held
    await store.reserve("p", limits, 1, 0, now=NOW, slot_id="r3")
    # A slot whose request was never settled (its replica died) stops counting at its deadline.
    await store.reserve("p", limits, 1, 0, now=NOW + DEFAULT_SLOT_TTL_S + 1, slot_id="r4")


@pytest.mark.parametrize(
    ("period", "start", "end"),
    [
        ("daily", "2026-03-04T00:00:00", "2026-03-05T00:00:00"),
        ("weekly", "2026-03-02T00:00:00", "2026-03-09T00:00:00"),  # ISO weeks start on Monday
        ("monthly", "2026-02-01T00:00:00", "2026-03-01T00:00:00"),
    ],
)
async def test_budget_periods(store, period, start, end):
    begin = datetime.fromisoformat(start).replace(tzinfo=UTC).timestamp()
    finish = datetime.fromisoformat(end).replace(tzinfo=UTC).timestamp()
    limits = QuotaLimits(budget=0.01, budget_period=period)  # 10_000 micro-units
    now = begin + (finish - begin) / 2
    await store.reserve("b", limits, 1, 6000, now=now)
    with pytest.raises(QuotaExceeded) as info:
        await store.reserve("b", limits, 1, 6000, now=finish - 1)
    assert info.value.reason == "budget" and info.value.retry_after_s == 1
    await store.reserve("b", limits, 1, 6000, now=finish)  # the next period starts empty
    with pytest.raises(QuotaExceeded):
        await store.reserve("b", limits, 1, 6000, now=begin)  # the period's first second counts too


async def test_check_refuses_as_reserve_would_and_applies_nothing(store):
    limits = QuotaLimits(tokens_per_minute=100, max_parallel_requests=1)
    key_limits = QuotaLimits(requests_per_minute=5)
    await store.check("c", limits, 100, 0, now=NOW, key_id="k1", key_limits=key_limits)
    assert await used(store, "c", limits, now=NOW) == {"tokens_per_minute": 0, "max_parallel_requests": 0}
    held = await store.reserve("c", limits, 60, 0, now=NOW, slot_id="r1")
    with pytest.raises(QuotaExceeded) as info:  # the one parallel slot is held
        await store.check("c", limits, 1, 0, now=NOW + 1)
    assert info.value.reason == "max_parallel_requests"
    await store.reconcile(held, 60, 0)
    await store.check("c", limits, 40, 0, now=NOW + 1)  # exactly the room left
    with pytest.raises(QuotaExceeded) as info:
        await store.check("c", limits, 41, 0, now=NOW + 1)
    assert (info.value.reason, info.value.retry_after_s) == ("tokens_per_minute", 60)  # second 0 leaves at 61
    assert (await used(store, "c", limits, now=NOW + 1))["tokens_per_minute"] == 60
    await store.reserve("c", limits, 40, 0, now=NOW + 2)  # the checks took nothing


async def test_reserve_reports_what_the_binding_limits_leave(store):
    tenant = QuotaLimits(
        requests_per_minute=3,
        tokens_per_minute=100,
        tokens_per_day=1000,
        max_parallel_requests=2,
        window="fixed",
    )
    key = QuotaLimits(tokens_per_minute=70, window="fixed")
    first = await store.reserve("h", tenant, 40, 0, now=NOW, key_id="k", key_limits=key, slot_id="r1")
    state = first.rate_limits
    assert state is not None
    # The key's 70 a minute binds before the tenant's 100 a minute and 1000 a day.
    assert (state.tokens.limit, state.tokens.remaining, state.tokens.reset_s) == (70, 30, 50)
    assert (state.requests.limit, state.requests.remaining, state.requests.reset_s) == (3, 2, 50)
    assert state.headers() == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "50s",
        "x-ratelimit-limit-tokens": "70",
        "x-ratelimit-remaining-tokens": "30",
        "x-ratelimit-reset-tokens": "50s",
    }
    await store.reconcile(first, 10, 0)  # 30 of the 40 reserved come back
    second = await store.reserve("h", tenant, 50, 0, now=NOW + 5, key_id="k", key_limits=key)
    assert (second.rate_limits.tokens.remaining, second.rate_limits.requests.remaining) == (10, 1)
    with pytest.raises(QuotaExceeded) as info:
        await store.reserve("h", tenant, 20, 0, now=NOW + 6, key_id="k", key_limits=key)
    refused = info.value.rate_limits
    assert (refused.tokens.limit, refused.tokens.remaining, refused.requests.remaining) == (70, 10, 1)
    assert "60 of 70 tokens a minute used, this request needs 20" in str(info.value)
    assert "resets in 44s" in str(info.value)
    with pytest.raises(QuotaExceeded) as info:  # the read-only check reports the same levels
        await store.check("h", tenant, 20, 0, now=NOW + 6, key_id="k", key_limits=key)
    assert info.value.rate_limits == refused


async def test_only_the_limited_units_are_reported(store):
    spend_only = await store.reserve("s", QuotaLimits(spend_per_day=1.0), 10, 5, now=NOW)
    assert spend_only.rate_limits.headers() == {  # ctxgate's spend trio, in the currency's units
        "x-ratelimit-limit-spend": "1",
        "x-ratelimit-remaining-spend": "0.999995",
        "x-ratelimit-reset-spend": "1h46m50s",
    }
    unlimited = await store.reserve("u", QuotaLimits(max_parallel_requests=5), 10, 5, now=NOW)
    assert unlimited.rate_limits is None  # parallel slots have no header
    daily = await store.reserve("d", QuotaLimits(tokens_per_day=500), 10, 0, now=NOW)
    assert daily.rate_limits.requests is None
    assert daily.rate_limits.headers()["x-ratelimit-remaining-tokens"] == "490"
    assert daily.rate_limits.headers()["x-ratelimit-reset-tokens"].endswith("m50s")


def test_resets_are_written_as_openai_writes_them():
    from ctxgate.gateway.quota.refusal import go_duration

    assert [go_duration(s) for s in (0, 1, 59, 60, 360, 3661, 86400)] == [
        "0s",
        "1s",
        "59s",
        "1m0s",
        "6m0s",
        "1h1m1s",
        "24h0m0s",
    ]
