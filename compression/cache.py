"""Byte caches shared by the compressor (embeddings, history summaries).

One small protocol (so a shared store can be plugged in) and its in-process LRU implementation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol, runtime_checkable


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
