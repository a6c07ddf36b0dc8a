"""A byte cache in Redis (embeddings, history summaries) that survives restarts and is shared by
every gateway replica, behind a circuit breaker: when Redis is down, slow or refusing, the cache
answers "miss" at once and compression goes on (it only loses the cache), and the breaker stops
paying a connect timeout per call until a trial call after `cooldown_s` finds Redis back.

Keys are the caller's (the embedder's are `emb:<model name>[:int8|:bf16]:<content hash>`), so vectors of
different models never mix. Batched reads (`get_many`) cost one round trip per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


class CircuitBreaker:
    """closed -> (failure_threshold consecutive failures) -> open -> (cooldown_s) -> half-open: one
    trial call; success closes the breaker, failure opens it again."""

    def __init__(
        self, failure_threshold: int = 3, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ):
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_running = False
        self._lock = threading.Lock()
        self.rejected = 0  # calls answered "miss" without touching Redis

    @property
    def state(self) -> str:
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "half-open" if self._clock() - self._opened_at >= self.cooldown_s else "open"

    def allow(self) -> bool:
        with self._lock:
            state = self._state()
            if state == "closed":
                return True
            if state == "half-open" and not self._trial_running:
                self._trial_running = True  # one trial at a time; the others keep missing
                return True
            self.rejected += 1
            return False

    def succeeded(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._trial_running = False

    def failed(self) -> None:
        with self._lock:
            self._failures += 1
            if self._trial_running or self._failures >= self.failure_threshold:
                if self._opened_at is None or self._trial_running:
                    logger.warning("embedding cache unavailable: circuit open for %.1f s", self.cooldown_s)
                self._opened_at = self._clock()
            self._trial_running = False


class RedisBytesCache:
    """`BytesCache` over Redis (redis-py, synchronous: it is called from compression worker threads)."""

    def __init__(
        self,
        url: str,
        key_prefix: str = "ctxgate:",
        ttl_s: float | None = 7 * 24 * 3600,
        timeout_s: float = 0.2,
        breaker: CircuitBreaker | None = None,
    ):
        import redis

        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.breaker = breaker or CircuitBreaker()
        # Short timeouts and no retries: a cache that is slow to answer is worth less than a miss.
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self.hits = 0
        self.misses = 0
        self.errors = 0

    def _call(self, operation: Callable[[], Any], default: Any) -> Any:
        from redis.exceptions import RedisError

        if not self.breaker.allow():
            return default
        try:
            result = operation()
        except (RedisError, OSError) as exc:
            self.errors += 1
            self.breaker.failed()
            logger.debug("embedding cache call failed: %s", exc)
            return default
        self.breaker.succeeded()
        return result

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        values = self._call(lambda: self._client.mget([self.key_prefix + key for key in keys]), None)
        if values is None:
            values = [None] * len(keys)
        found = sum(value is not None for value in values)
        self.hits += found
        self.misses += len(keys) - found
        return list(values)

    def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        self.set_many({key: value}, ttl_s)

    def set_many(self, items: dict[str, bytes], ttl_s: float | None = None) -> None:
        if not items:
            return
        ttl = ttl_s if ttl_s is not None else self.ttl_s

        def write() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items.items():
                pipe.set(self.key_prefix + key, value, ex=int(ttl) if ttl else None)
            pipe.execute()

        self._call(write, None)

    def close(self) -> None:
        self._client.close()
