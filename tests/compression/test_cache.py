from compression.cache import ByteLRU, BytesCache, LRUBytesCache, byte_bounded_cache
from compression.text import SentenceSplitter, content_words, normalize_for_dedup


def test_lru_evicts_by_size():
    cache = LRUBytesCache(max_bytes=12)  # two 1-byte keys with 5-byte values
    cache.set("a", b"12345")
    cache.set("b", b"12345")
    assert cache.get("a") == b"12345"  # a is now most recent
    cache.set("c", b"12345")
    assert cache.get("b") is None and cache.get("a") == b"12345" and cache.get("c") == b"12345"


def test_lru_batch_calls_are_its_single_calls():
    cache = LRUBytesCache(max_bytes=100)
    assert isinstance(cache, BytesCache)
    cache.set_many({"a": b"1", "b": b"22"})
    assert cache.get_many(["b", "missing", "a"]) == [b"22", None, b"1"]
    assert (cache.hits, cache.misses) == (2, 1)


def test_lru_counts_key_bytes_too():
    cache = LRUBytesCache(max_bytes=100)
    cache.set("k" * 60, b"v")
    cache.set("j" * 60, b"v")  # 61 + 61 > 100: the first goes
    assert cache.get("k" * 60) is None and cache.get("j" * 60) == b"v"


def test_byte_lru_is_bounded_by_bytes_as_well_as_count():
    cache = ByteLRU(max_entries=1000, max_bytes=4 * 1024 * 1024)
    texts = [chr(ord("a") + i) * (1024 * 1024) for i in range(10)]  # ten 1 MiB keys
    for text in texts:
        cache.put(text, 1)
        assert cache.size_bytes <= cache.max_bytes
    assert len(cache) == 3  # 1 MiB + overhead each: three fit in 4 MiB, the oldest went first
    assert texts[-1] in cache and texts[0] not in cache
    cache.put("z" * (5 * 1024 * 1024), 1)  # larger than the whole budget: not kept, nothing evicted
    assert len(cache) == 3
    small = ByteLRU(max_entries=2, max_bytes=1 << 20)
    for key in "abc":
        small.put(key, key)
    assert "a" not in small and len(small) == 2  # the count bound still holds


def test_byte_lru_clear_empties_it_and_its_byte_count():
    lru: ByteLRU[str, bytes] = ByteLRU(max_entries=10, max_bytes=10_000)
    lru.put("a", b"1")
    lru.clear()
    assert len(lru) == 0 and lru.size_bytes == 0 and lru.get("a") is None


def test_byte_bounded_cache_memoizes_within_its_budget():
    calls = []

    @byte_bounded_cache(max_entries=100, max_bytes=1024 * 1024)
    def upper(text: str) -> str:
        calls.append(text)
        return text.upper()

    assert upper("abc") == "ABC" and upper("abc") == "ABC" and calls == ["abc"]
    for i in range(20):  # 20 x (100 KiB key + 100 KiB value) against a 1 MiB budget
        upper(str(i) * (100 * 1024 // len(str(i))))
    assert upper.cache.size_bytes <= 1024 * 1024 and len(upper.cache) < 10


def test_client_text_caches_stay_within_their_byte_budgets():
    # The caches keyed by request text: huge distinct texts must not pile up past the budget.
    normalize_for_dedup("x")
    big = [f"{i} " + "word " * 400_000 for i in range(30)]  # 2 MB each, 60 MB in all
    for text in big:
        normalize_for_dedup(text)
        content_words(text)
    assert normalize_for_dedup.cache.size_bytes <= normalize_for_dedup.cache.max_bytes
    assert content_words.cache.size_bytes <= content_words.cache.max_bytes
    assert normalize_for_dedup.cache.max_bytes < 60_000_000
    splitter = SentenceSplitter(max_bytes=1024 * 1024)
    for text in big[:3]:
        splitter.split(text[:300_000] + ". End.")
    assert splitter._cache.size_bytes <= 1024 * 1024
