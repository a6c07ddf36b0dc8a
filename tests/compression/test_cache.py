import shutil
import socket
import subprocess
import time

import pytest

from compression.cache import LRUBytesCache, RedisBytesCache


def test_lru_evicts_by_size():
    cache = LRUBytesCache(max_bytes=10)
    cache.set("a", b"12345")
    cache.set("b", b"12345")
    assert cache.get("a") == b"12345"  # a is now most recent
    cache.set("c", b"12345")
    assert cache.get("b") is None and cache.get("a") == b"12345" and cache.get("c") == b"12345"


@pytest.fixture
def redis_url(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is required (apt-get install -y redis-server)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.redis
def test_redis_cache_round_trip_and_outage_is_a_miss(redis_url):
    cache = RedisBytesCache(redis_url)
    cache.set("k", b"\x00\x01binary")
    assert cache.get("k") == b"\x00\x01binary"
    assert cache.get("missing") is None
    unreachable = RedisBytesCache("redis://127.0.0.1:1/0")
    assert unreachable.get("k") is None
    unreachable.set("k", b"v")  # no exception


@pytest.mark.redis
def test_embeddings_are_shared_through_redis(redis_url, embedder):
    import numpy as np

    from compression.embeddings import Embedder

    writer = Embedder(cache=RedisBytesCache(redis_url))
    reader = Embedder(cache=RedisBytesCache(redis_url))
    vector = writer.embed(["a sentence seen by another replica"])
    assert writer.encoded_texts == 1
    np.testing.assert_allclose(reader.embed(["a sentence seen by another replica"]), vector)
    assert reader.encoded_texts == 0
