import pytest

from ctxgate.compression.counting import CachedCounter
from ctxgate.compression.store.cache import (
    BUDGET_SHARES,
    DEFAULT_CACHE_BYTES,
    ByteLRU,
    BytesCache,
    LRUBytesCache,
    budget_bytes,
    byte_bounded_cache,
    cache_usage,
    set_cache_budget,
)
from ctxgate.compression.text import SentenceSplitter, content_words, normalize_for_dedup


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


# -- one byte budget for every cache of per-request data (compression_cache_mb) --------------------


@pytest.fixture
def small_budget():
    """The process-wide budget at 1 MiB for one test, the default again after it."""
    set_cache_budget(1024 * 1024)
    yield
    set_cache_budget(DEFAULT_CACHE_BYTES)


def test_the_shares_add_up_to_the_whole_budget():
    assert sum(BUDGET_SHARES.values()) == pytest.approx(1.0)


def test_the_budget_bounds_counts_splits_summaries_and_word_caches(tokenizer, small_budget):
    counter = CachedCounter(tokenizer)
    splitter = SentenceSplitter()
    summaries = LRUBytesCache()
    for i in range(120):  # ~1 MB of unique 8 KB texts through each: ten times each one's share
        text = f"Document {i}. " + f"Sentence {i} about item {i * 7}. " * 250
        counter.count(text)
        splitter.split(text)
        summaries.set(f"summary:{i}", text.encode())
        content_words(text)
    for name, cache in (
        ("token_counts", counter._counts),
        ("sentences", splitter._cache),
        ("summaries", summaries),
        ("content_words", content_words.cache),
    ):
        assert 0 < cache.size_bytes <= budget_bytes(name), name
    assert counter.count(text) == tokenizer.count(text)  # still exact after evictions


def test_usage_reports_what_each_share_holds_against_its_bound(tokenizer, small_budget):
    counter = CachedCounter(tokenizer)
    for i in range(300):  # ~300 KB of unique text: three times the share
        counter.count(f"text {i} " * 100)
    usage = {share.name: share for share in cache_usage()}
    assert set(usage) == set(BUDGET_SHARES)
    counts = usage["token_counts"]
    # Every live counter has the whole share: this one and any other test's that is still alive.
    assert counts.instances >= 1 and counts.limit_bytes == counts.instances * budget_bytes("token_counts")
    assert counter._counts.size_bytes <= counts.held_bytes <= counts.limit_bytes
    assert counts.entries >= len(counter._counts) > 0


def test_lowering_the_budget_evicts_what_no_longer_fits(tokenizer):
    counter = CachedCounter(tokenizer)
    try:
        for i in range(300):
            counter.count(f"text {i} " * 100)
        before = counter._counts.size_bytes
        set_cache_budget(256 * 1024)
        assert counter._counts.size_bytes <= budget_bytes("token_counts") < before
    finally:
        set_cache_budget(DEFAULT_CACHE_BYTES)


def test_an_explicit_bound_is_kept_whatever_the_budget():
    lru = LRUBytesCache(max_bytes=100)
    set_cache_budget(8 * 1024 * 1024)
    try:
        assert lru.max_bytes == 100
    finally:
        set_cache_budget(DEFAULT_CACHE_BYTES)


def test_the_embedders_vectors_are_bounded_by_bytes_not_only_by_count(embedder, small_budget):
    budget = budget_bytes("embeddings")  # ~360 KiB: about 220 384-float vectors
    embedder.embed([f"Sentence number {i} mentions widget {i * 13}." for i in range(400)])
    assert 0 < embedder._local.size_bytes <= budget
    assert len(embedder._local) < 400


def test_a_budget_below_one_byte_is_refused():
    with pytest.raises(ValueError, match="at least 1 byte"):
        set_cache_budget(0)
