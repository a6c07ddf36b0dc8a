"""`ctxgate serve` limits glibc's malloc arenas (backend/platform/malloc_arenas.py): each case runs in a
fresh interpreter (the limit is per process and fixed once threads have arenas), starts threads that
allocate, and counts the arenas glibc reports (`malloc_info`'s <heap> elements)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from tests.support.servers import ctxgate_env

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

THREADS = 8
SCRIPT = f"""
import ctypes, re, sys, tempfile, threading
from ctxgate.backend.platform.malloc_arenas import limit_malloc_arenas

applied = limit_malloc_arenas() if sys.argv[1] == "limit" else None
barrier = threading.Barrier({THREADS})
held = []

def allocate():
    barrier.wait()  # all at once: each thread's first malloc looks for an arena of its own
    held.append(bytearray(1 << 20))

threads = [threading.Thread(target=allocate) for _ in range({THREADS})]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
with tempfile.NamedTemporaryFile("r", suffix=".xml") as report:
    stream = libc.fopen(report.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    heaps = len(re.findall(r"<heap nr=", report.read()))
print(applied, heaps)
"""


def _arenas(mode: str, **env: str) -> tuple[str, int]:
    environment = {k: v for k, v in ctxgate_env(**env).items() if env or k != "MALLOC_ARENA_MAX"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    applied, heaps = done.stdout.split()
    return applied, int(heaps)


def test_without_the_limit_threads_that_allocate_get_arenas_of_their_own():
    # The control: what the limit prevents happens here (otherwise the next test proves nothing).
    assert _arenas("none")[1] > 2


def test_the_server_limit_keeps_every_thread_within_two_arenas():
    applied, heaps = _arenas("limit")
    assert applied == "True"
    assert heaps <= 2


def test_the_operators_malloc_arena_max_wins():
    applied, heaps = _arenas("limit", MALLOC_ARENA_MAX="3")
    assert applied == "False"
    assert heaps == 3
