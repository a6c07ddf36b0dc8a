"""A real `ctxgate serve` process: secrets stay out of its logs; SIGTERM drains and refuses new work with 503."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from ctxgate.gateway.key_admin import add_key
from tests.reliability.conftest import MODEL_NAME
from tests.support.servers import free_port, wait_http, write_policy

pytestmark = pytest.mark.timeout(240)

SECRET_PROMPT = "zebra-quartz-7781 is my private medical note"
SECRET_DOCUMENT = "ledger-omega-4420 confidential salary table"
SLOW_POLICY = (
    "name: rel\nmax_input_tokens: 256\nreserve_output_tokens: 64\ncompression_enabled: false\n"
    "history: {enabled: false, max_tokens: 256}\ndocuments: {max_tokens: 200}\n"
    "dedup: {enabled: false}\nrerank: {enabled: false}\nextraction: {enabled: false}\n"
)


def _start_server(root, key_name: str = "acme") -> tuple[subprocess.Popen, str, str, object]:
    """A `ctxgate serve` process on a free port, logging to root/server.log: (process, url, key, log file)."""
    policies = root / "policies"
    policies.mkdir()
    write_policy(policies, "rel", SLOW_POLICY)
    keys_file = root / "keys.yaml"
    key = add_key(keys_file, key_name)
    port = free_port()
    log = open(root / "server.log", "w")  # noqa: SIM115 (closed by the caller)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("REDIS_URL", None)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ctxgate",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy-dir",
            str(policies),
            "--default-policy",
            "rel",
            "--keys",
            str(keys_file),
            "--max-in-flight",
            "2",
            "--max-queued",
            "0",
            "--drain-timeout",
            "60",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    return process, f"http://127.0.0.1:{port}", key, log


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    process, url, key, log = _start_server(root)
    try:
        wait_http(f"{url}/ready", timeout_s=180)
        yield {"url": url, "key": key, "process": process, "log_path": root / "server.log"}
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        log.close()


def _headers(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def _body(content: str, max_tokens: int, stream: bool = False, documents: list[str] | None = None) -> dict:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if documents:
        body["ctxgate"] = {"documents": [{"text": text} for text in documents]}
    return body


def test_keys_and_prompts_are_not_logged(served):
    url, key = served["url"], served["key"]
    ok = httpx.post(
        f"{url}/v1/chat/completions",
        headers=_headers(key),
        timeout=120,
        json=_body(SECRET_PROMPT, 2, documents=[SECRET_DOCUMENT]),
    )
    assert ok.status_code == 200, ok.text
    # Error paths too: a wrong key, a bad value next to the secret prompt, an over-budget prompt.
    assert (
        httpx.post(
            f"{url}/v1/chat/completions", headers=_headers(key + "x"), json=_body(SECRET_PROMPT, 2)
        ).status_code
        == 401
    )
    bad = _body(SECRET_PROMPT, 2) | {"temperature": -3}
    assert httpx.post(f"{url}/v1/chat/completions", headers=_headers(key), json=bad).status_code == 400
    huge = _body(SECRET_PROMPT * 200, 2)
    assert httpx.post(
        f"{url}/v1/chat/completions", headers=_headers(key), json=huge, timeout=60
    ).status_code in (400, 413)
    time.sleep(0.5)
    log = served["log_path"].read_text()
    assert "Application startup complete" in log or "Uvicorn running" in log, log[-2000:]
    for secret in (
        key,
        key[len("cg-") :] if key.startswith("cg-") else key,
        "zebra-quartz-7781",
        "ledger-omega-4420",
    ):
        assert secret not in log, f"{secret!r} found in the server log"


def _stream_to_end(url: str, key: str, results: list, first_chunk: threading.Event) -> None:
    try:
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            headers=_headers(key),
            timeout=120,
            json=_body("Count slowly.", 64, stream=True),
        ) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    first_chunk.set()
            results.append((response.status_code, events))
    except Exception as exc:  # reported by the test
        results.append((None, repr(exc)))
        first_chunk.set()


def test_sigterm_drains_in_flight_and_refuses_new_requests(served):
    url, key, process = served["url"], served["key"], served["process"]
    results: list = []
    started = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream_to_end, args=(url, key, results, event)) for event in started]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(60), "streams did not start"

    process.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the drain begins on the server's next tick (0.1 s)
    refused = httpx.post(f"{url}/v1/chat/completions", headers=_headers(key), json=_body("Hi", 2), timeout=30)
    assert refused.status_code == 503, refused.text
    assert refused.headers.get("retry-after")
    assert refused.json()["error"]["code"] == "overloaded"
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 503

    for thread in threads:
        thread.join(120)
    assert len(results) == 2
    for status, events in results:
        assert status == 200, events
        assert events[-1] == "[DONE]"
        finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e).get("choices", [])]
        assert finishes[-1] == "length", events[-3:]
    exit_code = process.wait(timeout=60)
    log = served["log_path"].read_text()
    assert exit_code == 0, log[-3000:]
    assert "draining" in log and "drained" in log
    assert key not in log


def test_sigterm_while_the_embedding_model_loads_exits_cleanly(tmp_path):
    """The embedding model loads and warms up on a thread after startup. A SIGTERM that lands then
    used to abort the process after a clean drain (exit -6, "terminate called without an active
    exception": the thread was still in torch when the interpreter finalized)."""
    process, url, _key, log = _start_server(tmp_path)
    log_path = tmp_path / "server.log"
    try:
        # /health, not /ready: /ready waits for the very load this SIGTERM must interrupt.
        wait_http(f"{url}/health", timeout_s=180)
        deadline = time.monotonic() + 120
        while "Loading SentenceTransformer model" not in log_path.read_text():
            assert time.monotonic() < deadline, "the embedding model never started loading"
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        exit_code = process.wait(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        log.close()
    text = log_path.read_text()
    assert exit_code == 0, text[-3000:]
    assert "drained" in text and "terminate called" not in text
