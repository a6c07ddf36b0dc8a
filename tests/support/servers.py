"""Real servers for tests: uvicorn serving an app in a thread, on a free port of the loopback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.support.waiting import eventually


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerThread:
    """uvicorn serving an app in a background thread (its own event loop), on a free port."""

    def __init__(self, app: Any, port: int | None = None, start_timeout_s: float = 60.0):
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s = start_timeout_s
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()

        def started() -> bool:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            return self.server.started

        eventually(started, timeout_s=self.start_timeout_s, interval_s=0.02, message="uvicorn did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextmanager
def serve_engine(engine: Any) -> Iterator[str]:
    """The engine's own OpenAI server (`ctxgate engine serve`'s app) in a thread; yields its base URL."""
    from backend.server import create_app

    with ServerThread(create_app(engine)) as running:
        yield running.url


def wait_http(url: str, timeout_s: float = 30.0, status: int = 200) -> None:
    """Until GET `url` answers `status` (a server process starting up)."""
    last: list[int | None] = [None]

    def answers() -> bool:
        try:
            last[0] = httpx.get(url, timeout=1.0).status_code
        except httpx.HTTPError:
            return False
        return last[0] == status

    eventually(answers, timeout_s=timeout_s, interval_s=0.1, message=f"{url} did not answer {status}")


def write_policy(directory: Path, name: str, text: str) -> Path:
    """Write a policy file atomically (a hot-reloading gateway never reads half of it)."""
    path = directory / f"{name}.yaml"
    tmp = directory / f".{name}.tmp"
    tmp.write_text(text)
    tmp.replace(path)
    return path
