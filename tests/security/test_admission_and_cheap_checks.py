"""A hostile tenant holding one valid key, against a real gateway (uvicorn, the real engine):

- a megabyte of newlines is a clean 413/400, never a 500 nor the tokenizer library's own text, and
  /health keeps answering while it is tokenized;
- connections trickling their bodies hold no admission slot, and one key's open and queued requests
  are capped, so another tenant is served;
- a tenant without quota left is refused before its document is compressed.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from ctxgate.gateway.app import create_app
from ctxgate.gateway.keys import hash_key
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.conftest import engine  # noqa: F401
from tests.support.servers import ServerThread

MODEL = "SmolLM2-135M-Instruct"
KEYS = {name: f"cg-{name}-secret" for name in ("flooder", "victim", "spent")}
NEWLINES = "\n" * 1_000_000
LIBRARY_WORDS = ("regex", "backtrack", "stack size", "tiktoken", "valueerror")
HEALTH_BUDGET_S = 1.0
OPEN_PER_KEY = 3

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory) -> Iterator[ServerThread]:  # noqa: F811
    root = tmp_path_factory.mktemp("admission")
    tenants = {name: {"keys": [{"sha256": hash_key(secret)}]} for name, secret in KEYS.items()}
    tenants["spent"]["quota"] = {"tokens_per_minute": 50}
    (root / "keys.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    # One running and one waiting place in all: a single key could take both on main.
    settings = GatewaySettings(
        keys_file=root / "keys.yaml",
        max_in_flight=1,
        max_queued=1,
        queue_timeout_s=20,
        max_open_per_key=OPEN_PER_KEY,
        body_read_timeout_s=20,
    )
    app = create_app(settings, engine=engine)
    with ServerThread(app) as running:
        running.app = app
        yield running


def _headers(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


def _chat(content: str = "Say one word.", **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0,
        **extra,
    }


def _assert_no_library_text(response: httpx.Response) -> None:
    text = response.text.lower()
    assert not any(word in text for word in LIBRARY_WORDS), response.text


def _health_while(url: str, work) -> tuple[httpx.Response, list[float]]:
    """`work()`'s response, and /health round trips measured while it ran."""
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(response=work()))
    thread.start()
    times = []
    with httpx.Client(timeout=30) as client:
        while thread.is_alive() or not times:
            started = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            times.append(time.perf_counter() - started)
            time.sleep(0.02)
    thread.join()
    return outcome["response"], times


# -- every tokenizer path on big input ---------------------------------------------------------------
def test_a_megabyte_of_newlines_as_a_prompt_is_a_clean_413_and_health_answers(server):
    def send() -> httpx.Response:
        body = {"model": MODEL, "prompt": NEWLINES, "max_tokens": 1}
        return httpx.post(f"{server.url}/v1/completions", json=body, headers=_headers("victim"), timeout=120)

    response, health = _health_while(server.url, send)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "prompt_too_long"
    assert response.json()["error"]["param"] == "prompt"
    # Refused from its length alone (a lower bound of its tokens), before any tokenizing.
    assert "the prompt has at least " in response.json()["error"]["message"]
    _assert_no_library_text(response)
    assert max(health) < HEALTH_BUDGET_S, health


@pytest.mark.parametrize("where", ["message", "document"])
def test_a_megabyte_of_whitespace_to_compress_never_shows_the_library_text(server, where):
    body = (
        _chat("What is it?" + NEWLINES)
        if where == "message"
        else _chat("What is it?", ctxgate={"documents": [{"text": " " * 1_000_000 + "It is a cat."}]})
    )
    response = httpx.post(
        f"{server.url}/v1/ctxgate/compress", json=body, headers=_headers("victim"), timeout=240
    )
    assert response.status_code in (200, 400, 413), response.text
    _assert_no_library_text(response)


# -- admission per key ---------------------------------------------------------------------------------
def _trickling(port: int, key: str | None) -> socket.socket:
    """A connection that sent its headers and one byte of a 1,000-byte body, and sends nothing more."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: 1000\r\n\r\n{{".encode()
    )
    return sock


def _status(sock: socket.socket, timeout_s: float) -> int:
    sock.settimeout(timeout_s)
    head = sock.recv(4096).decode("latin-1")
    return int(head.split(" ", 2)[1])


def test_slow_bodies_from_one_key_leave_another_tenant_served(server):
    held = [_trickling(server.port, KEYS["flooder"]) for _ in range(OPEN_PER_KEY)]
    extra = [_trickling(server.port, KEYS["flooder"]) for _ in range(3)]
    try:
        # The held ones are still sending their bodies: they take no place another tenant needs.
        started = time.perf_counter()
        response = httpx.post(
            f"{server.url}/v1/chat/completions", json=_chat(), headers=_headers("victim"), timeout=60
        )
        assert response.status_code == 200, response.text
        assert time.perf_counter() - started < 15
        # Beyond its open-request cap the key is refused at once, with its own 429.
        assert [_status(sock, 5) for sock in extra] == [429] * len(extra)
        # A key the gateway does not know is refused before its body, whatever it sends.
        for key in (None, "cg-not-a-key"):
            stranger = _trickling(server.port, key)
            try:
                assert _status(stranger, 5) == 401
            finally:
                stranger.close()
    finally:
        for sock in held + extra:
            sock.close()


def test_the_per_key_refusal_names_the_limit(server):
    held = [_trickling(server.port, KEYS["flooder"]) for _ in range(OPEN_PER_KEY)]
    try:
        response = httpx.post(
            f"{server.url}/v1/chat/completions", json=_chat(), headers=_headers("flooder"), timeout=30
        )
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "too_many_open_requests"
        assert response.headers["retry-after"]
    finally:
        for sock in held:
            sock.close()


# -- cheap checks first ----------------------------------------------------------------------------------
def _compressions(server) -> float:
    registry = server.app.state.gateway.metrics.registry
    return registry.get_sample_value("ctxgate:compression_wait_seconds_count") or 0.0


@pytest.mark.parametrize("path", ["/v1/ctxgate/compress", "/v1/chat/completions"])
def test_a_tenant_without_quota_is_refused_before_its_document_is_compressed(server, path):
    document = " ".join(f"Sentence {i} says the cat number {i} sat on mat {i}." for i in range(4000))
    body = _chat("Which cat sat on mat 7?", ctxgate={"documents": [{"id": "d", "text": document}]})
    before = _compressions(server)
    started = time.perf_counter()
    response = httpx.post(f"{server.url}{path}", json=body, headers=_headers("spent"), timeout=60)
    elapsed = time.perf_counter() - started
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "tokens_per_minute"
    assert _compressions(server) == before  # nothing was compressed for it
    assert elapsed < 0.5, elapsed
