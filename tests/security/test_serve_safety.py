"""A real `ctxgate serve` process: it will not serve a reachable address open by accident, /metrics
can need a key, 5xx bodies are generic (details in the log, under the request id), and a body
trickled in too slowly is cut off."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.servers import REPO, ctxgate_env, ctxgate_process, free_port, wait_http
from tests.support.waiting import eventually

METRICS_KEY = "scrape-secret"


def _serve(args: list[str], **kwargs) -> subprocess.Popen:
    """A serve process expected to exit by itself (refusing to start)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ctxgate", "--log-level", "WARNING", "serve", *args],
        cwd=REPO,
        env=ctxgate_env(CTXGATE_METRICS_KEY=""),
        **kwargs,
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gateway.internal"])
def test_open_gateway_on_a_reachable_address_refuses_to_start(host, tmp_path):
    # A dead upstream and a tiktoken tokenizer: nothing to load, the refusal comes first anyway.
    process = _serve(
        [
            "--host",
            host,
            "--port",
            str(free_port()),
            "--upstream",
            "http://127.0.0.1:9/v1",
            "--tokenizer",
            "cl100k_base",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2
    message = stderr.decode()
    assert "without a keys file" in message and host in message
    assert "--keys" in message and "--allow-unauthenticated" in message  # says how


def test_config_file_host_without_keys_refuses_too(tmp_path):
    config = tmp_path / "ctxgate.yaml"
    config.write_text(
        f"server: {{host: 0.0.0.0, port: {free_port()}, tokenizer: cl100k_base}}\n"
        "upstreams: {urls: ['http://127.0.0.1:9/v1']}\n"
    )
    process = _serve(["--config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2 and "server.allow_unauthenticated" in stderr.decode()


@contextmanager
def _open_gateway(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Serving 0.0.0.0 without keys, allowed by the config file; /metrics keyed; a 1 s body timeout;
    an upstream nobody listens on (so generation fails with a 502)."""
    port = free_port()
    config = tmp_path / "ctxgate.yaml"
    config.write_text(
        f"server: {{host: 0.0.0.0, port: {port}, tokenizer: cl100k_base, allow_unauthenticated: true,\n"
        "         body_read_timeout: 1.0}\n"
        f"upstreams: {{urls: ['http://127.0.0.1:{free_port()}/v1'], model: m, connect_timeout: 0.2, retries: 0}}\n"
        "metrics: {key: os.environ/SCRAPE_KEY}\n"
    )
    log = tmp_path / "gateway.log"
    env = ctxgate_env(CTXGATE_METRICS_KEY="", SCRAPE_KEY=METRICS_KEY)
    with ctxgate_process(["serve", "--config", str(config), "--served-model-name", "m"], log, env):
        wait_http(f"http://127.0.0.1:{port}/health", timeout_s=120)
        yield f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with _open_gateway(tmp_path_factory.mktemp("open")) as running:
        yield running


def test_allowed_explicitly_it_serves(gateway):
    url, _ = gateway
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_metrics_need_the_metrics_key(gateway):
    url, _ = gateway
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": METRICS_KEY}):
        refused = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
        assert refused.status_code == 401 and "ctxgate:" not in refused.text
        assert refused.json()["error"]["code"] == "invalid_api_key"
    allowed = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=10)
    assert allowed.status_code == 200 and "ctxgate:upstream_up" in allowed.text


def test_a_502_is_generic_and_the_log_has_the_details(gateway):
    url, log = gateway
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for streamed in (False, True):
        response = httpx.post(f"{url}/v1/chat/completions", json=body | {"stream": streamed}, timeout=30)
        assert response.status_code == 502, response.text
        request_id = response.headers["x-request-id"]
        assert response.json()["error"]["message"] == f"the model backend failed (request id {request_id})"
        assert (
            "127.0.0.1" not in response.text and "http" not in response.text and "Error" not in response.text
        )
        eventually(
            lambda request_id=request_id: request_id in log.read_text(),
            timeout_s=10,
            interval_s=0.1,
            message="the failure was not logged with its request id",
        )
        logged = [line for line in log.read_text().splitlines() if request_id in line]
        assert any("no upstream could take the request" in line and "127.0.0.1" in line for line in logged)


def test_a_trickled_body_is_cut_off(gateway):
    url, _ = gateway
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        started = time.monotonic()
        sock.settimeout(0.3)
        reply = b""
        while b"\r\n\r\n" not in reply:
            assert time.monotonic() - started < 10, "the slow body was never cut off"
            try:
                sock.sendall(b" ")  # one byte every 0.3 s: never done within the 1 s limit
            except OSError:
                break
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            reply += chunk
        elapsed = time.monotonic() - started
        sock.settimeout(5)
        while b"}}" not in reply:  # the JSON error body may come in a later segment
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"body_read_timeout" in reply
    assert 0.9 <= elapsed < 5
    # A body sent at a normal pace is unaffected.
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
