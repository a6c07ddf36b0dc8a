"""The tokens a tenant can still reserve (`QuotaStore.tokens_left`), the same from both ledgers."""

from __future__ import annotations

import pytest

from ctxgate.gateway.quota import InProcessQuotaStore, QuotaLimits, RedisQuotaStore

NOW = 1_699_999_990.0  # 10 s into a minute, far from the end of the day


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        yield InProcessQuotaStore()
        return
    redis_store = RedisQuotaStore(request.getfixturevalue("redis_server").url)
    yield redis_store
    await redis_store.close()


async def test_room_is_the_tightest_token_limit_left(store):
    limits = QuotaLimits(tokens_per_minute=1_000, tokens_per_day=1_500, requests_per_minute=50)
    assert await store.tokens_left("t", limits, now=NOW) == 1_000
    reservation = await store.reserve("t", limits, 700, 0, now=NOW)
    assert await store.tokens_left("t", limits, now=NOW) == 300
    await store.reconcile(reservation, 900, 0)  # used more than reserved: the room shrinks again
    assert await store.tokens_left("t", limits, now=NOW) == 100
    # Once the reservation's second has left the sliding minute (61 s on), the day has only 600 left.
    assert await store.tokens_left("t", limits, now=NOW + 60) == 100
    assert await store.tokens_left("t", limits, now=NOW + 61) == 600


async def test_a_keys_own_limit_bounds_the_room(store):
    limits, key_limits = QuotaLimits(tokens_per_minute=1_000), QuotaLimits(tokens_per_minute=400)
    await store.reserve("t", limits, 100, 0, now=NOW, key_id="k", key_limits=key_limits)
    assert await store.tokens_left("t", limits, now=NOW, key_id="k", key_limits=key_limits) == 300
    assert await store.tokens_left("t", limits, now=NOW) == 900


async def test_no_token_limit_is_no_room_figure_and_reading_reserves_nothing(store):
    assert await store.tokens_left("t", QuotaLimits(requests_per_minute=1), now=NOW) is None
    limits = QuotaLimits(tokens_per_minute=100)
    for _ in range(3):
        assert await store.tokens_left("t", limits, now=NOW) == 100
    assert [(u.name, u.used) for u in await store.usage("t", limits, now=NOW)] == [("tokens_per_minute", 0)]
