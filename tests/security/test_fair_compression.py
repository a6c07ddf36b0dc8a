"""One tenant's huge document does not hold another tenant's small compress behind it (issue 48,
item 10): a real `ctxgate serve` with one compression worker, tenant b compressing a 200k-character
document of unique sentences, tenant c sending a small compress while b's runs. With a first-come
first-served pool, c waited for the whole of b's work; with the fair scheduler (compression/fair.py)
c's request finishes while b's is still running, in about its own time."""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from ctxgate.gateway.keys import hash_key
from tests.support.servers import ctxgate_process, free_port, wait_http

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"b": "cg-fair-b-secret", "c": "cg-fair-c-secret"}
BIG_CHARS = 600_000  # several seconds of compression on an idle 2-core machine, so c arrives while b runs
SMALL_CHARS = 3_000

pytestmark = pytest.mark.timeout(900)


def unique_document(chars: int, seed: int) -> str:
    """Sentences no cache has seen (every seed its own words), `chars` long."""
    rng = random.Random(seed)
    vocabulary = [f"{rng.choice('bcdfghklmnprstvz')}{rng.randrange(10**6)}" for _ in range(5000)]
    parts: list[str] = []
    size = 0
    while size < chars:
        sentence = "The " + " ".join(rng.choice(vocabulary) for _ in range(rng.randrange(8, 20))) + ". "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:chars]


def compress_body(text: str) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Which one is k17?"}],
        "ctxgate": {"documents": [{"id": "d", "title": "Report", "text": text}]},
    }


def compress(url: str, tenant: str, body: dict) -> float:
    started = time.perf_counter()
    response = httpx.post(
        f"{url}/v1/ctxgate/compress",
        json=body,
        headers={"authorization": f"Bearer {KEYS[tenant]}"},
        timeout=600,
    )
    assert response.status_code == 200, response.text[:300]
    return time.perf_counter() - started


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("fair-compression")
    tenants = {name: {"keys": [{"sha256": hash_key(secret)}]} for name, secret in KEYS.items()}
    (root / "keys.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    port = free_port()
    args = [
        "serve",
        "--port",
        str(port),
        "--keys-file",
        str(root / "keys.yaml"),
        "--compression-workers",
        "1",
        "--default-policy",
        "rag-default",
    ]
    with ctxgate_process(args, root / "gateway.log"):
        wait_http(f"http://127.0.0.1:{port}/ready", timeout_s=300)
        yield f"http://127.0.0.1:{port}"


def test_a_small_compress_is_not_queued_behind_another_tenants_huge_document(gateway):
    compress(gateway, "c", compress_body(unique_document(SMALL_CHARS, 1)))  # warm: first sight of the model
    alone = statistics.median(
        compress(gateway, "c", compress_body(unique_document(SMALL_CHARS, 10 + i))) for i in range(3)
    )
    big_body = compress_body(unique_document(BIG_CHARS, 99))
    big: dict[str, float] = {}
    big_done = threading.Event()

    def send_big() -> None:
        big["seconds"] = compress(gateway, "b", big_body)
        big_done.set()

    sender = threading.Thread(target=send_big)
    sender.start()
    time.sleep(0.5)  # b's document is being compressed (the request itself lands in milliseconds)
    behind = compress(gateway, "c", compress_body(unique_document(SMALL_CHARS, 20)))
    finished_first = not big_done.is_set()
    sender.join()
    report = f"c alone {alone:.2f}s, c behind b {behind:.2f}s, b {big['seconds']:.2f}s"
    print(report)  # the numbers, for `pytest -s`
    assert finished_first, f"c's compress waited for b's whole document ({report})"
    assert behind < 0.5 * big["seconds"], report
    assert behind < 4 * alone + 2.0, report
