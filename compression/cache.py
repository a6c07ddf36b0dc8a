"""Byte caches shared by the compressor (embeddings, history summaries).

One small protocol with two implementations: an in-process LRU (default) and Redis (several gateway
replicas share summaries and embeddings). Cache failures never fail a request: a Redis error is a
miss.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)


@runtime_checkable
class BytesCache(Protocol):
    def get(self, key: str) -> bytes | None: ...

    def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None: ...


class LRUBytesCache:
    """Thread-safe in-process LRU bounded by total bytes stored."""

    def __init__(self, max_bytes: int = 256 * 1024 * 1024):
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return value

    def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        # ttl is ignored: eviction by size is enough for a process-local cache.
        with self._lock:
            previous = self._items.pop(key, None)
            if previous is not None:
                self._size -= len(previous)
            self._items[key] = value
            self._size += len(value)
            while self._size > self.max_bytes and self._items:
                _, evicted = self._items.popitem(last=False)
                self._size -= len(evicted)

    def __len__(self) -> int:
        return len(self._items)


class RedisBytesCache:
    """Redis-backed cache; every error is logged and treated as a miss."""

    def __init__(self, url: str, default_ttl_s: float | None = 7 * 24 * 3600, prefix: str = "ctxgate:"):
        import redis

        self._client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.default_ttl_s = default_ttl_s
        self.prefix = prefix

    def get(self, key: str) -> bytes | None:
        try:
            return self._client.get(self.prefix + key)
        except Exception as exc:  # a cache outage must not fail a request
            logger.warning("redis cache get failed: %s", exc)
            return None

    def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        ttl = ttl_s if ttl_s is not None else self.default_ttl_s
        try:
            self._client.set(self.prefix + key, value, ex=int(ttl) if ttl else None)
        except Exception as exc:
            logger.warning("redis cache set failed: %s", exc)


def make_cache(redis_url: str | None = None) -> BytesCache:
    return RedisBytesCache(redis_url) if redis_url else LRUBytesCache()
