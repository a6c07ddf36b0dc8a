"""The per-minute limits slide: no 60 seconds ever hold more than the limit, across any minute's end,
in the in-process ledger and in Redis (real redis-server) alike; reconcile credits the second it
reserved in."""

from __future__ import annotations

import pytest

from ctxgate.gateway.quota import InProcessQuotaStore, QuotaExceeded, QuotaLimits, RedisQuotaStore

MINUTE = 1_700_000_040.0  # the start of an epoch minute


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        yield InProcessQuotaStore()
        return
    redis_store = RedisQuotaStore(request.getfixturevalue("redis_server").url)
    yield redis_store
    await redis_store.close()


async def _try(store, tenant: str, limits: QuotaLimits, tokens: int, now: float) -> bool:
    try:
        await store.reserve(tenant, limits, tokens, 0, now=now)
    except QuotaExceeded:
        return False
    return True


def _most_in_any_span(admitted: list[tuple[float, int]]) -> tuple[int, int]:
    """The most requests and tokens admitted in any 60-second span [t, t + 60)."""
    most_requests = most_tokens = 0
    for start, _ in admitted:
        inside = [tokens for at, tokens in admitted if start <= at < start + 60]
        most_requests = max(most_requests, len(inside))
        most_tokens = max(most_tokens, sum(inside))
    return most_requests, most_tokens


async def test_a_burst_across_a_minute_boundary_gets_at_most_the_limit_in_any_60_s(store):
    limits = QuotaLimits(requests_per_minute=10, tokens_per_minute=1000)
    # The whole allowance at the end of one minute, then the start of the next: a fixed window
    # would admit both bursts (twice the limit within two seconds).
    assert [await _try(store, "t", limits, 50, MINUTE + 59.5) for _ in range(10)] == [True] * 10
    assert not await _try(store, "t", limits, 50, MINUTE + 60.5)
    with pytest.raises(QuotaExceeded) as refused:
        await store.reserve("t", limits, 50, 0, now=MINUTE + 61)
    # The burst's second (59) leaves the window at 120: room again in 59 s, not at the next minute.
    assert (refused.value.reason, refused.value.retry_after_s) == ("requests_per_minute", 59)
    assert "in the last 60 s" in str(refused.value)
    assert not await _try(store, "t", limits, 50, MINUTE + 119.9)
    assert await _try(store, "t", limits, 50, MINUTE + 120.0)

    # A steady offer every quarter second for three minutes, starting 10 s before a minute ends,
    # tokens varying: every 60-second span holds at most the limits, and the limit is reached.
    admitted: list[tuple[float, int]] = []
    for step in range(720):
        now, tokens = MINUTE + 290 + step * 0.25, 40 + (step * 37) % 150
        if await _try(store, "u", limits, tokens, now):
            admitted.append((now, tokens))
    most_requests, most_tokens = _most_in_any_span(admitted)
    assert most_requests <= 10 and most_tokens <= 1000, (most_requests, most_tokens)
    assert most_requests == 10 or most_tokens > 1000 - 190  # it was a limit that held, not idleness


async def test_the_fixed_window_stays_an_option(store):
    limits = QuotaLimits(requests_per_minute=10, window="fixed")
    assert all([await _try(store, "f", limits, 1, MINUTE + 59.5) for _ in range(10)])
    # Epoch minutes: the next one starts empty, which is the 2x a sliding window does not allow.
    assert all([await _try(store, "f", limits, 1, MINUTE + 60.5) for _ in range(10)])
    with pytest.raises(QuotaExceeded) as refused:
        await store.reserve("f", limits, 1, 0, now=MINUTE + 61)
    assert refused.value.retry_after_s == 59 and "a minute used" in str(refused.value)


async def test_reconcile_credits_the_second_the_request_was_reserved_in(store):
    limits = QuotaLimits(tokens_per_minute=1000)
    start = MINUTE + 0.2
    first = await store.reserve("r", limits, 600, 0, now=start)  # second 0
    await store.reserve("r", limits, 300, 0, now=start + 3)  # second 3
    await store.reconcile(first, 100, 0)  # settled 5 s later: 500 unused come back to second 0
    assert not await _try(store, "r", limits, 601, start + 6)
    await store.reserve("r", limits, 600, 0, now=start + 6)  # second 6: 100 + 300 + 600
    assert not await _try(store, "r", limits, 1, start + 60.7)  # second 0 still counts until 61
    # Second 0 (100 after the credit) has left: 300 + 600 remain, 100 fit and 101 do not.
    assert not await _try(store, "r", limits, 101, start + 60.9)
    assert await _try(store, "r", limits, 100, start + 60.9)
    usage = {u.name: u for u in await store.usage("r", limits, now=start + 60.9)}
    assert usage["tokens_per_minute"].used == 1000
    assert usage["tokens_per_minute"].reset_s == 61  # when second 60 leaves, the window is empty


async def test_a_late_reconcile_never_touches_a_second_that_left_the_window(store):
    limits = QuotaLimits(tokens_per_minute=100)
    early = await store.reserve("l", limits, 90, 0, now=MINUTE)
    await store.reserve("l", limits, 90, 0, now=MINUTE + 70)
    await store.reconcile(early, 10_000, 0)  # long gone: nothing is added anywhere
    usage = {u.name: u for u in await store.usage("l", limits, now=MINUTE + 71)}
    assert usage["tokens_per_minute"].used == 90


async def test_headers_and_usage_report_the_sliding_window(store):
    limits = QuotaLimits(requests_per_minute=5, tokens_per_minute=500)
    await store.reserve("h", limits, 100, 0, now=MINUTE + 30)
    reservation = await store.reserve("h", limits, 100, 0, now=MINUTE + 40.5)
    headers = reservation.rate_limits.headers()
    assert headers["x-ratelimit-remaining-requests"] == "3"
    assert headers["x-ratelimit-remaining-tokens"] == "300"
    assert headers["x-ratelimit-reset-tokens"] == "1m1s"  # second 40 leaves at 101
    reported = {usage["limit"]: usage for usage in (u.report() for u in reservation.usage)}
    assert reported["tokens_per_minute"]["used"] == 200 and reported["tokens_per_minute"]["remaining"] == 300
    assert reported["tokens_per_minute"]["resets_at"].endswith("+00:00")
