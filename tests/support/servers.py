"""Real servers for tests: uvicorn serving an app in a thread, on a free port of the loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.support.waiting import eventually

REPO = Path(__file__).resolve().parents[2]


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
def serve_engine(engine: Any, manage_engine: bool = True) -> Iterator[str]:
    """The engine's own OpenAI server (`ctxgate engine serve`'s app) in a thread; yields its base URL.
    `manage_engine=False`: the engine is started if it is not yet, and left running at the end (the
    session's shared engine, which other tests use after this server stops)."""
    from ctxgate.backend.serving.server import create_app

    if not manage_engine:
        engine.start()
    with ServerThread(create_app(engine, manage_engine=manage_engine)) as running:
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


def ctxgate_env(**extra: str) -> dict[str, str]:
    """The environment for a `ctxgate` child process running this checkout's code."""
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


@contextmanager
def ctxgate_process(
    args: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    stop_timeout_s: float = 20.0,
    must_stop: bool = False,
) -> Iterator[subprocess.Popen]:
    """`python -m ctxgate ARGS` from this checkout, its output in `log`; on exit SIGTERM, then SIGKILL
    after `stop_timeout_s` (an AssertionError then, when `must_stop`: a graceful stop is under test)."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "ctxgate", "--log-level", "WARNING", *args],
            cwd=REPO,
            env=dict(env if env is not None else ctxgate_env()),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        hung = False
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                hung = True
                process.kill()
                process.wait()
    if hung and must_stop:
        raise AssertionError(f"{' '.join(args)} did not stop within {stop_timeout_s:g}s of SIGTERM")


@contextmanager
def ctxgate_replicas(
    args: Sequence[str],
    logs: Path,
    env: Mapping[str, str] | None = None,
    count: int = 2,
    ready_timeout_s: float = 90.0,
    must_stop: bool = False,
) -> Iterator[list[str]]:
    """`count` `ctxgate serve ARGS --port P` processes, each on its own free port; yields their base URLs
    once every one answers /health."""
    with ExitStack() as stack:
        urls = []
        for index in range(count):
            port = free_port()
            stack.enter_context(
                ctxgate_process(
                    ["serve", *args, "--port", str(port)],
                    logs / f"replica{index}.log",
                    env,
                    stop_timeout_s=15,
                    must_stop=must_stop,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_http(f"{url}/health", timeout_s=ready_timeout_s)
        yield urls


def engine_serve_args(model_dir: Path | str, port: int, *extra: str) -> list[str]:
    """`ctxgate engine serve` on one thread with a small KV pool: several fit on a 2-core machine."""
    return [
        "engine",
        "serve",
        "--port",
        str(port),
        "--model",
        str(model_dir),
        "--num-threads",
        "1",
        "--kv-cache-memory-mb",
        "64",
        "--max-model-len",
        "2048",
        *extra,
    ]


@contextmanager
def engine_processes(
    model_dir: Path | str,
    logs: Path,
    count: int = 2,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 180.0,
) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """`count` real `ctxgate engine serve` processes; yields (base URL, process) once each answers /health
    (a test may kill one: leaving the block stops the others)."""
    with ExitStack() as stack:
        running = []
        for index in range(count):
            port = free_port()
            process = stack.enter_context(
                ctxgate_process(engine_serve_args(model_dir, port), logs / f"engine{index}.log", env)
            )
            running.append((f"http://127.0.0.1:{port}", process))
        for url, _ in running:
            wait_http(f"{url}/health", timeout_s=ready_timeout_s)
        yield running


LLAMA_SERVER_ENV = "CTXGATE_LLAMA_SERVER"


def llama_server_binary() -> str | None:
    """The llama.cpp `llama-server` the tests run ($CTXGATE_LLAMA_SERVER, set by .ci/run). Unset: None
    on a developer machine (the test skips), an error under CI, where it must run."""
    path = os.environ.get(LLAMA_SERVER_ENV)
    if path:
        if not Path(path).is_file():
            raise RuntimeError(f"${LLAMA_SERVER_ENV} names {path}, which is not a file")
        return path
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise RuntimeError(
            f"${LLAMA_SERVER_ENV} is not set under CI: .ci/run builds llama-server and sets it"
        )
    return None


@contextmanager
def llama_server(binary: str, gguf: Path, log: Path, alias: str = "smollm2") -> Iterator[str]:
    """llama.cpp's server on a free port, one thread, serving `gguf`; yields its base URL once /health is 200."""
    port = free_port()
    command = [
        binary,
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        "1",
        "-c",
        "2048",
        "--alias",
        alias,
        "-np",
        "2",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", timeout_s=120)
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
