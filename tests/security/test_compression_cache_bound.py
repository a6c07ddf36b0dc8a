"""What the compressor keeps of client text is bounded by `compression_cache_mb`, whatever a tenant
sends (issue 48, item 10): a real `ctxgate serve` with a 2 MiB budget is sent documents no cache has
seen, many times the budget, and its /metrics must show every cache within its share and the shares
adding up to the budget, with the caches that saw the text filled to their bound (so the bound, not
the traffic, is what stopped them).

This is why the hostile soak's RSS rises: the caches fill to their bound (at the default 512 MiB,
for longer than the soak) and the process levels off near its baseline plus about twice the budget
(the allocator's overhead on many small objects; docs/deploying.md)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
import yaml

from ctxgate.compression.store.cache import BUDGET_SHARES
from ctxgate.gateway.keys import hash_key
from tests.security.test_fair_compression import compress_body, unique_document
from tests.support.servers import ctxgate_process, free_port, wait_http

KEY = "cg-cache-bound-secret"
BUDGET_MIB = 2
DOCUMENTS, DOCUMENT_CHARS = 8, 40_000  # 320 KB of unique sentences: each text cache's share many times

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("cache-bound")
    (root / "keys.yaml").write_text(yaml.safe_dump({"tenants": {"t": {"keys": [{"sha256": hash_key(KEY)}]}}}))
    port = free_port()
    args = ["serve", "--port", str(port), "--keys-file", str(root / "keys.yaml")]
    args += ["--compression-cache-mb", str(BUDGET_MIB), "--compression-workers", "1"]
    args += ["--default-policy", "rag-default"]
    with ctxgate_process(args, root / "gateway.log"):
        wait_http(f"http://127.0.0.1:{port}/ready", timeout_s=300)
        yield f"http://127.0.0.1:{port}"


def _gauge(text: str, name: str) -> dict[str, float]:
    return {
        cache: float(value)
        for cache, value in re.findall(rf'^ctxgate:{name}{{cache="([a-z0-9_]+)"}} (\S+)$', text, re.M)
    }


def test_the_compression_caches_stay_within_the_budget_under_unique_documents(gateway):
    with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {KEY}"}) as client:
        for seed in range(DOCUMENTS):
            body = compress_body(unique_document(DOCUMENT_CHARS, 5_000 + seed))
            response = client.post(f"{gateway}/v1/ctxgate/compress", json=body)
            assert response.status_code == 200, response.text[:300]
        metrics = client.get(f"{gateway}/metrics").text
    held = _gauge(metrics, "compression_cache_bytes")
    limit = _gauge(metrics, "compression_cache_limit_bytes")
    report = f"held {held}, limits {limit}"
    assert set(held) == set(limit) == set(BUDGET_SHARES), report
    for cache in BUDGET_SHARES:
        assert held[cache] <= limit[cache], report
    # One cache of each share in the server: the limits are the budget, split.
    budget = BUDGET_MIB * 1024 * 1024
    assert budget - len(BUDGET_SHARES) <= sum(limit.values()) <= budget, report
    # The per-sentence caches saw far more text than their share: they are full, bounded by bytes.
    for cache in ("token_counts", "content_words"):
        assert held[cache] > 0.5 * limit[cache], report
