"""Fixtures for gateway tests: a real engine, real uvicorn servers on free ports, real redis-server."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerThread:
    """uvicorn serving an app in a background thread (its own event loop), on a free port."""

    def __init__(self, app, port: int | None = None):
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture(scope="session")
def engine(model_dir):
    """The real in-process engine, shared by every gateway test server in this session."""
    from backend.async_engine import AsyncEngine
    from backend.config import EngineConfig

    engine = AsyncEngine(EngineConfig(model=str(model_dir), kv_cache_memory_mb=64, max_model_len=2048))
    yield engine
    engine.shutdown()


def wait_http(url: str, timeout_s: float = 30.0, status: int = 200) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url, timeout=1.0).status_code
            if last == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer {status} (last: {last})")


class RedisServer:
    """A throwaway redis-server on a free port, no persistence; can be stopped and restarted."""

    def __init__(self, workdir: Path):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            # A skip here would hide a missing install step in .ci/run: the Redis tests must run.
            pytest.fail("redis-server is required (apt-get install -y redis-server)")
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


def write_policy(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.yaml"
    tmp = directory / f".{name}.tmp"
    tmp.write_text(text)
    tmp.replace(path)
    return path


class RecordingEngine:
    """Wraps a real engine and records which requests ran to the end and which were cut short."""

    def __init__(self, inner):
        self.inner = inner
        self.model_name = inner.model_name
        self.max_model_len = inner.max_model_len
        self.path_info = inner.path_info
        self.tokenizer = inner.tokenizer
        self.metrics_registry = inner.metrics_registry
        self.forwards_fields = inner.forwards_fields
        self.side_work = inner.side_work
        self.finished: list[str] = []
        self.cut_short: list[str] = []
        self.aborted: list[str] = []

    @property
    def needs_health_check(self) -> bool:
        return self.inner.needs_health_check

    def start(self) -> None:
        self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    def is_ready(self) -> bool:
        return self.inner.is_ready()

    async def check_health(self) -> bool:
        return await self.inner.check_health()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await self.inner.abort(request_id)

    async def generate(self, request):
        iterator = self.inner.generate(request)
        finished = False
        try:
            async for delta in iterator:
                finished = finished or delta.finish_reason is not None
                yield delta
        finally:
            (self.finished if finished else self.cut_short).append(request.request_id)
            await iterator.aclose()
