from compression.cache import LRUBytesCache


def test_lru_evicts_by_size():
    cache = LRUBytesCache(max_bytes=10)
    cache.set("a", b"12345")
    cache.set("b", b"12345")
    assert cache.get("a") == b"12345"  # a is now most recent
    cache.set("c", b"12345")
    assert cache.get("b") is None and cache.get("a") == b"12345" and cache.get("c") == b"12345"
