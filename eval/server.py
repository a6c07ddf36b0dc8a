"""Start the real gateway (`python -m ctxgate serve`) as a child process for an eval run.

A separate process keeps the eval's own client work (tokenizing, scoring, plotting) off the
gateway's event loop, and is exactly what a user runs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ctxgate.eval.status import Status, StatusLine

# While a server starts, its last log line is repeated this often (seconds), so a slow start shows
# what it is doing instead of looking hung.
HEARTBEAT_S = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GatewayProcess:
    """Context manager: `with GatewayProcess(policy_dir=...) as url: ...`. Says on `status` (default:
    stderr) when it starts, what its log says while it loads, and when it is ready."""

    ready_path = "/ready"
    what = "the gateway (ctxgate serve)"

    def __init__(
        self,
        policy_dir: str | Path | None = None,
        model: str | None = None,
        log_path: str | Path | None = None,
        ready_timeout_s: float = 600.0,
        extra_args: list[str] | None = None,
        env: dict[str, str | None] | None = None,
        status: StatusLine | None = None,
        heartbeat_s: float = HEARTBEAT_S,
    ):
        self.status = status or Status()
        self.heartbeat_s = heartbeat_s
        self.policy_dir = policy_dir
        # Environment changes for the child (None removes a variable, e.g. REDIS_URL for a cold cache).
        self.env_changes = env or {}
        self.model = model
        self.log_path = Path(log_path) if log_path else None
        self.ready_timeout_s = ready_timeout_s
        self.extra_args = extra_args or []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file = None

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "ctxgate", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.policy_dir:
            command += ["--policy-dir", str(self.policy_dir)]
        if self.model:
            command += ["--model", self.model]
        return command + self.extra_args

    def start(self) -> str:
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        repo_root = Path(__file__).resolve().parent.parent
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")])),
        }
        for name, value in self.env_changes.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        log_note = f"; its log: {self.log_path}" if self.log_path else ""
        self.status(f"starting {self.what} on {self.url}{log_note}")
        self._process = subprocess.Popen(
            self.command(),
            stdout=self._log_file or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            cwd=str(repo_root),
            env=env,
        )
        self._wait_ready()
        return self.url

    def _log_tail(self, max_chars: int = 3000) -> str:
        if not self.log_path or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_text(errors="replace")[-max_chars:]

    def _last_log_line(self) -> str:
        """The log's last line, without its timestamp, level and logger (what the server is doing)."""
        lines = [line for line in self._log_tail(2000).splitlines() if line.strip()]
        if not lines or not self.log_path:
            return ""
        message = lines[-1].rsplit("]: ", 1)[-1].strip()
        return message if len(message) <= 120 else message[:117] + "..."

    def _wait_ready(self) -> None:
        assert self._process is not None
        started = time.monotonic()
        next_beat = started + self.heartbeat_s

        def heartbeat() -> None:
            nonlocal next_beat
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.heartbeat_s
                said = self._last_log_line()
                self.status(f"still starting ({now - started:.0f} s)" + (f": {said}" if said else ""))

        try:
            wait_until_ok(
                f"{self.url}{self.ready_path}",
                self._process,
                "gateway",
                started + self.ready_timeout_s,
                on_wait=heartbeat,
            )
        except RuntimeError as exc:
            tail = self._log_tail()
            self.stop()
            raise RuntimeError(f"{exc}:\n{tail}") from None
        self.status(f"{self.what} ready at {self.url} after {time.monotonic() - started:.1f} s")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None


class EngineServerProcess(GatewayProcess):
    """`ctxgate engine serve` (the built-in engine's own OpenAI server, no gateway) on a free port."""

    ready_path = "/health"
    what = "the engine server (ctxgate engine serve)"

    def command(self) -> list[str]:
        command = [
            sys.executable,
            "-m",
            "ctxgate",
            "engine",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if self.model:
            command += ["--model", self.model]
        return command + self.extra_args


class InProcessGateway:
    """The gateway app (`ctxgate.gateway.app.create_app`) served by uvicorn in a background thread of this
    process, on a free port. Lets a caller share one already-loaded engine across several gateways
    (e.g. the sweep's derived-policy gateway and a plain one) instead of loading the model again."""

    def __init__(
        self, policy_dir: str | Path | None = None, engine: object | None = None, model: str | None = None
    ):
        self.policy_dir = policy_dir
        self.engine = engine
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self._thread = None

    def start(self) -> str:
        import threading

        import uvicorn

        from ctxgate.gateway.app import create_app
        from ctxgate.gateway.settings import GatewaySettings

        settings = GatewaySettings(
            host="127.0.0.1",
            port=self.port,
            model=self.model,
            policy_dir=Path(self.policy_dir) if self.policy_dir else None,
        )
        app = create_app(settings, engine=self.engine)  # type: ignore[arg-type]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="ctxgate-eval-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError("the in-process gateway stopped during startup (see the log above)")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2.0).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the in-process gateway was not ready after 600 s")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def wait_until_ok(
    url: str,
    process: subprocess.Popen,
    what: str,
    deadline: float,
    on_wait: Callable[[], None] | None = None,
) -> None:
    """Poll `url` until it answers 200; RuntimeError when `process` exits first or the monotonic
    `deadline` passes. `on_wait` runs between polls (a caller's progress report)."""
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready in time")
        if on_wait is not None:
            on_wait()
        time.sleep(0.5)
