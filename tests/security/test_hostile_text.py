"""Client text built to make backtracking regular expressions blow up, sent to a real `ctxgate serve`
(built-in engine, rag-default with every stage on): while each payload is processed the process still
answers /health within a second, and the payload itself gets an answer or a 4xx within seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.servers import ctxgate_process, free_port, wait_http

MODEL = "SmolLM2-135M-Instruct"
SIZE = 200_000  # characters; the old patterns took hours at this size
HEALTH_BUDGET_S = 1.0
ANSWER_BUDGET_S = 30.0  # a few seconds of real work on 2 busy cores, with room for a slow CI machine

pytestmark = pytest.mark.timeout(900)


def _documents(text: str, title: str = "A title") -> dict:
    return {
        "documents": [
            {"id": "d1", "title": title, "text": text},
            {"id": "d2", "title": "Paris", "text": "Paris is the capital of France."},
        ]
    }


def _chat(content: str, system: str | None = None, ctxgate: dict | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": content})
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        **({"ctxgate": ctxgate} if ctxgate else {}),
    }


# Each payload as the issue reported it (a blank-line run in a document, a "context" header followed
# by spaces, a run of unterminated tags, a title of an open parenthesis and spaces), at SIZE.
PAYLOADS = {
    "document_newlines": _chat("What is the capital of France?", ctxgate=_documents("\n" * SIZE + "x")),
    "document_marker_indent": _chat(
        "Which city?", ctxgate=_documents((" " * 50 + "\n") * (SIZE // 51) + "Question: x")
    ),
    "message_context_spaces": _chat("context" + " " * SIZE + "x"),
    "message_doc_tags": _chat("<doc>" * (SIZE // 5) + " What is it?"),
    "message_attribute_run": _chat("<document " + "a" * SIZE + "> text </document> What?"),
    "system_source_tabs": _chat("What?", system="Answer from the sources.\n\nSource" + "\t" * SIZE + "x"),
    "system_numbered_headers": _chat("What?", system="Use these.\n" + "Document [1](Title: " * (SIZE // 20)),
    "title_open_paren": _chat("Who is it?", ctxgate=_documents("Some text about it.", title="(" + " " * 999)),
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("hostile-text") / "gateway.log"
    args = [
        "serve",
        "--port",
        str(port),
        "--default-policy",
        "rag-default",
        "--max-body-bytes",
        str(4 * 1024 * 1024),
    ]
    with ctxgate_process(args, log):
        wait_http(f"http://127.0.0.1:{port}/ready", timeout_s=300)
        yield f"http://127.0.0.1:{port}"


def _health_while(url: str, busy: threading.Event) -> list[float]:
    """/health round trips, measured while `busy` is set (at least one, however fast the payload)."""
    times = []
    with httpx.Client(timeout=30) as client:
        while True:
            started = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            times.append(time.perf_counter() - started)
            if not busy.is_set():
                return times
            time.sleep(0.05)


@pytest.mark.parametrize("endpoint", ["/v1/ctxgate/compress", "/v1/chat/completions"])
@pytest.mark.parametrize("name", list(PAYLOADS))
def test_hostile_text_never_freezes_the_gateway(gateway, name, endpoint):
    outcome: dict = {}
    busy = threading.Event()
    busy.set()

    def send() -> None:
        started = time.perf_counter()
        try:
            response = httpx.post(f"{gateway}{endpoint}", json=PAYLOADS[name], timeout=300)
            outcome["status"] = response.status_code
            outcome["body"] = response.text[:300]
        finally:
            outcome["seconds"] = time.perf_counter() - started
            busy.clear()

    sender = threading.Thread(target=send)
    sender.start()
    health = _health_while(gateway, busy)
    sender.join()
    assert outcome["status"] == 200 or 400 <= outcome["status"] < 500, outcome
    assert outcome["seconds"] < ANSWER_BUDGET_S, outcome
    assert max(health) < HEALTH_BUDGET_S, f"/health took up to {max(health):.2f}s ({outcome})"


def test_an_oversized_title_is_a_clear_400(gateway):
    body = _chat("Who?", ctxgate=_documents("text", title="(" + " " * SIZE))
    response = httpx.post(f"{gateway}/v1/ctxgate/compress", json=body, timeout=60)
    assert response.status_code == 400
    assert "title" in response.json()["error"]["message"]
