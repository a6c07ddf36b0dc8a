"""Caches shared by the compressor (embeddings, history summaries, per-text results).

One small protocol (so a shared store can be plugged in) and its in-process LRU implementation,
plus `ByteLRU` / `byte_bounded_cache` for results keyed by client text: a count bound alone lets a
client fill memory with a few thousand 8 MiB texts, so these are bounded by the bytes of their keys
and values as well.

Every cache of per-request data takes its byte budget from one total (`set_cache_budget`; the
gateway's `compression_cache_mb`), split by `BUDGET_SHARES`, so the memory the compressor keeps for
client text has one stated bound whatever the traffic (tests/reliability/memory_soak.py shows RSS
levelling off under it).
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")
Result = TypeVar("Result")

DEFAULT_CACHE_BYTES = 512 * 1024 * 1024
# Each cache's part of the total. Embedding vectors (1.5 KB per sentence) are what first-sight
# traffic fills fastest and what saves the most time on a repeat.
BUDGET_SHARES: dict[str, float] = {
    "embeddings": 0.35,  # compression/embedding/embeddings.py: sentence vectors
    "summaries": 0.15,  # history summaries (the pipeline's LRUBytesCache)
    "token_counts": 0.10,  # compression/counting.py: per-text token counts (each CachedCounter)
    "sentences": 0.10,  # compression/text.py: sentence splits
    "content_words": 0.10,  # compression/text.py: word sets
    "bm25": 0.10,  # compression/rerank.py: term counts
    "dedup_forms": 0.05,  # compression/text.py: normalised forms
    "names": 0.03,  # compression/multihop/names.py: normalised names
    "mention_patterns": 0.02,  # compression/multihop/names.py: compiled patterns
}


class BudgetedCache(Protocol):
    """A cache that holds part of the budget: how much it holds, its bound, and a way to change it."""

    @property
    def size_bytes(self) -> int: ...

    @property
    def max_bytes(self) -> int: ...

    def resize(self, max_bytes: int) -> None: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class CacheUsage:
    """One budget share's caches now: what they hold (bytes, entries) and their bound (each instance
    of a share has the whole share, so the bound is the share times the instances)."""

    name: str
    instances: int
    held_bytes: int
    limit_bytes: int
    entries: int


_total_bytes = DEFAULT_CACHE_BYTES
_tracked: dict[str, weakref.WeakSet[BudgetedCache]] = {name: weakref.WeakSet() for name in BUDGET_SHARES}
_budget_lock = threading.Lock()


def budget_bytes(name: str) -> int:
    """The byte budget of the caches named `name` (each instance has this much)."""
    return max(1, int(_total_bytes * BUDGET_SHARES[name]))


def track_budget(name: str, cache: BudgetedCache) -> None:
    """`cache` follows `set_cache_budget` from now on, and counts in `cache_usage`."""
    with _budget_lock:
        _tracked[name].add(cache)
    cache.resize(budget_bytes(name))


def set_cache_budget(total_bytes: int) -> None:
    """Resize every tracked cache to its share of `total_bytes` (evicting what no longer fits)."""
    global _total_bytes
    if total_bytes < 1:
        raise ValueError(f"the cache budget must be at least 1 byte, not {total_bytes}")
    with _budget_lock:
        _total_bytes = total_bytes
        caches = [(name, cache) for name, group in _tracked.items() for cache in list(group)]
    for name, cache in caches:
        cache.resize(budget_bytes(name))


def cache_budget() -> int:
    return _total_bytes


def cache_usage() -> list[CacheUsage]:
    """What each share's live caches hold now (the gateway exports it on /metrics)."""
    with _budget_lock:
        groups = [(name, list(group)) for name, group in _tracked.items()]
    return [
        CacheUsage(
            name,
            len(caches),
            sum(cache.size_bytes for cache in caches),
            sum(cache.max_bytes for cache in caches),
            sum(len(cache) for cache in caches),
        )
        for name, caches in groups
    ]


def approx_size(value: Any, depth: int = 2) -> int:
    """Bytes an object holds, roughly: its own size plus (a level or two deep) its items'. Cheap next
    to computing the value it sizes; strings and bytes, the large part, are exact."""
    size = sys.getsizeof(value)
    if depth <= 0 or isinstance(value, (str, bytes, int, float)):
        return size
    if isinstance(value, dict):
        return size + sum(approx_size(k, depth - 1) + approx_size(v, depth - 1) for k, v in value.items())
    if isinstance(value, (tuple, list, set, frozenset)):
        return size + sum(approx_size(item, depth - 1) for item in value)
    pattern = getattr(value, "pattern", None)  # a compiled regex: its source is the variable part
    return size + (sys.getsizeof(pattern) * 4 if isinstance(pattern, str) else 0)


class ByteLRU(Generic[Key, Value]):
    """Thread-safe LRU bounded by entry count and by the total bytes of keys and values; an entry
    larger than the whole budget is not kept."""

    def __init__(self, max_entries: int, max_bytes: int, sizer: Callable[[Any], int] = approx_size):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._sizer = sizer
        self._items: OrderedDict[Key, tuple[Value, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.size_bytes = 0

    def get(self, key: Key) -> Value | None:
        with self._lock:
            found = self._items.get(key)
            if found is None:
                return None
            self._items.move_to_end(key)
            return found[0]

    def put(self, key: Key, value: Value) -> None:
        cost = self._sizer(key) + self._sizer(value)
        if cost > self.max_bytes:
            return
        with self._lock:
            previous = self._items.pop(key, None)
            if previous is not None:
                self.size_bytes -= previous[1]
            self._items[key] = (value, cost)
            self.size_bytes += cost
            self._evict()

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            self._evict()

    def _evict(self) -> None:
        while self._items and (self.size_bytes > self.max_bytes or len(self._items) > self.max_entries):
            _, (_, evicted) = self._items.popitem(last=False)
            self.size_bytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.size_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Key) -> bool:
        return key in self._items


def byte_bounded_cache(
    max_entries: int, max_bytes: int | None = None, budget: str | None = None
) -> Callable[[Callable[[Key], Result]], Callable[[Key], Result]]:
    """functools.lru_cache for one-argument functions of client text, with a byte bound too:
    `max_bytes`, or the cache budget's share named `budget` (following `set_cache_budget`). The
    wrapped function gets `.cache` (the ByteLRU) for inspection."""
    if (max_bytes is None) == (budget is None):
        raise ValueError("give max_bytes or budget")

    def decorate(function: Callable[[Key], Result]) -> Callable[[Key], Result]:
        cache: ByteLRU[Key, Result] = ByteLRU(max_entries, max_bytes or budget_bytes(budget or ""))
        if budget is not None:
            track_budget(budget, cache)

        @functools.wraps(function)
        def cached(argument: Key) -> Result:
            found = cache.get(argument)
            if found is not None:
                return found
            result = function(argument)
            cache.put(argument, result)
            return result

        cached.cache = cache  # type: ignore[attr-defined]
        return cached

    return decorate


@runtime_checkable
class BytesCache(Protocol):
    """Bytes by key, shared by the embedder (vectors) and the history summarizer (summaries)."""

    def get(self, key: str) -> bytes | None: ...

    def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None: ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """`get` of each key, in one round trip where the store has one (Redis MGET)."""
        ...

    def set_many(self, items: dict[str, bytes], ttl_s: float | None = None) -> None:
        """`set` of each item, in one round trip where the store has one."""
        ...


class LRUBytesCache:
    """Thread-safe in-process LRU bounded by total bytes stored (keys and values)."""

    def __init__(self, max_bytes: int | None = None):
        """`max_bytes` None: the "summaries" share of the cache budget (and it follows changes)."""
        self.max_bytes = max_bytes if max_bytes is not None else budget_bytes("summaries")
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        if max_bytes is None:
            track_budget("summaries", self)

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
                self._size -= len(key) + len(previous)
            self._items[key] = value
            self._size += len(key) + len(value)
            self._evict()

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            self._evict()

    def _evict(self) -> None:
        while self._size > self.max_bytes and self._items:
            evicted_key, evicted = self._items.popitem(last=False)
            self._size -= len(evicted_key) + len(evicted)

    @property
    def size_bytes(self) -> int:
        return self._size

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(key) for key in keys]

    def set_many(self, items: dict[str, bytes], ttl_s: float | None = None) -> None:
        for key, value in items.items():
            self.set(key, value, ttl_s)

    def __len__(self) -> int:
        return len(self._items)
