"""The embedding cache in Redis: vectors survive a restart and are shared by replicas; a Redis outage
(a real redis-server stopped mid-test) costs only cache misses, and the circuit breaker stops
calling Redis until a trial call after the cooldown finds it back."""

from __future__ import annotations

import numpy as np
import pytest

from ctxgate.compression.store.redis_cache import CircuitBreaker, RedisBytesCache

pytestmark = pytest.mark.redis


class FakeClock:
    """The breaker's clock, moved by the test (no sleeping, no timing assumptions)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_lets_one_trial_through_after_cooldown():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=5, clock=clock)
    assert breaker.allow()
    breaker.failed()
    assert breaker.state == "closed" and breaker.allow()
    breaker.failed()
    assert breaker.state == "open" and not breaker.allow() and breaker.rejected == 1
    clock.now += 5
    assert breaker.state == "half-open"
    assert breaker.allow() and not breaker.allow()  # one trial at a time
    breaker.failed()  # the trial failed: open again for a full cooldown
    assert breaker.state == "open"
    clock.now += 5
    assert breaker.allow()
    breaker.succeeded()
    assert breaker.state == "closed" and breaker.allow()


@pytest.fixture
def embedder_with(embedder):
    """The session's embedding model with a given byte cache and an empty in-process cache (a freshly
    started replica); the byte cache is restored afterwards."""
    saved = embedder._cache

    def attach(cache):
        embedder._cache = cache
        embedder._local.clear()
        return embedder

    yield attach
    embedder._cache = saved


TEXTS = ["Ida Holm is the mayor of Arlen.", "The river Vey runs north of Brisk.", "Cirra has 870 people."]


def test_vectors_survive_a_restart_and_are_shared_by_another_replica(redis_server, embedder_with):
    first = embedder_with(RedisBytesCache(redis_server.url, key_prefix="t1:"))
    encoded = first.encoded_texts
    vectors = first.embed(TEXTS)
    assert first.encoded_texts == encoded + len(TEXTS)
    replica_cache = RedisBytesCache(redis_server.url, key_prefix="t1:")
    replica = embedder_with(replica_cache)  # new connection, empty in-process cache
    again = replica.embed(TEXTS)
    assert replica.encoded_texts == encoded + len(TEXTS)  # nothing encoded twice
    assert replica_cache.hits == len(TEXTS)
    np.testing.assert_array_equal(again, vectors)


def test_an_outage_costs_only_misses_and_the_breaker_stops_calling_redis(
    redis_server, embedder_with, tmp_path
):
    clock = FakeClock()
    cache = RedisBytesCache(
        redis_server.url,
        key_prefix="t2:",
        timeout_s=0.2,
        breaker=CircuitBreaker(failure_threshold=2, cooldown_s=30, clock=clock),
    )
    embedder = embedder_with(cache)
    reference = embedder.embed(TEXTS)
    redis_server.stop()
    embedder._local.clear()
    during = embedder.embed(TEXTS)  # Redis is gone: get and set fail, the vectors are computed
    np.testing.assert_allclose(during, reference, atol=1e-5)
    assert cache.errors == 2 and cache.breaker.state == "open"
    embedder._local.clear()
    embedder.embed(TEXTS)
    assert cache.errors == 2 and cache.breaker.rejected == 2  # open: Redis is not even tried

    redis_server.start()  # same port, empty (no persistence)
    clock.now += 30
    embedder._local.clear()
    embedder.embed(TEXTS)  # the trial read reaches Redis (a miss), closes the breaker; the write lands
    assert cache.breaker.state == "closed"
    embedder._local.clear()
    hits = cache.hits
    embedder.embed(TEXTS)
    assert cache.hits == hits + len(TEXTS)
