"""Helpers for tests that need the engine behind a real uvicorn server on a free port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from backend.async_engine import AsyncEngine
from backend.server import create_app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(engine: AsyncEngine) -> Iterator[str]:
    """Serve `engine` with uvicorn in a thread; yields the base URL (`http://127.0.0.1:PORT`)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def wait_until_pool_free(engine: AsyncEngine, timeout: float = 30.0) -> None:
    """Poll the engine until no request runs or waits and every KV block is back in the pool."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (
            stats.num_running == 0
            and stats.num_waiting == 0
            and stats.num_kv_blocks_free == stats.num_kv_blocks_total
        ):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks not freed: {stats}")
        time.sleep(0.05)


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` in a Prometheus exposition."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name = head.split("{", 1)[0]
        if metric_name != name:
            continue
        if all(f'{key}="{val}"' in head for key, val in labels.items()):
            total += float(value)
    return total
