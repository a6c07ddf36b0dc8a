"""A real, throwaway redis-server for the tests that share a quota ledger or a cache."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support.servers import free_port
from tests.support.waiting import eventually


class RedisServer:
    """A redis-server on a free port, no persistence; can be stopped and restarted."""

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
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def accepting() -> bool:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return True
            return False

        eventually(accepting, timeout_s=10, message="redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None
