"""A serving process's glibc malloc: few arenas and big blocks mapped on their own, so freed request
memory is reused or returned, not hoarded.

glibc gives threads that allocate at the same time arenas of their own, up to eight per core. A
server's threads (event loop, engine, compression workers, embedder batcher, tokenizer pools) each
handle 100k to 1M-character bodies in turn; what one frees stays in its arena as free space that the
others cannot use, so the process's resident memory rises with every arena that has held a big
request and keeps rising as the arenas fragment. Two arenas keep that free space shared and small
(docs/deploying.md, "Memory").

Set at process start, before the threads allocate (glibc fixes its arena limit when the ninth arena
would be made). `MALLOC_ARENA_MAX` and `MALLOC_MMAP_THRESHOLD_` in the environment, read by glibc
itself, win: an operator can still choose. Anywhere but glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

SERVER_ARENAS = 2
# Blocks from this size up are mapped on their own and returned to the system when freed. glibc
# otherwise raises its threshold to the largest block freed so far (up to 32 MiB), after which a
# request's big transient buffers (bodies, token arrays, activations) are carved from the heap and
# what they leave fragments it.
SERVER_MMAP_THRESHOLD = 256 * 1024
M_ARENA_MAX = -8  # glibc's mallopt parameter numbers
M_MMAP_THRESHOLD = -3


def tune_malloc() -> None:
    """A serving process's malloc settings, at its start: few arenas, big blocks returned when freed."""
    limit_malloc_arenas()
    fix_mmap_threshold()


def _mallopt() -> Callable[[int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def fix_mmap_threshold(threshold: int = SERVER_MMAP_THRESHOLD) -> bool:
    """Map blocks of `threshold` bytes and more on their own from now on, whatever was freed before;
    False where not applied (the environment already sets MALLOC_MMAP_THRESHOLD_, or no glibc)."""
    mallopt = None if os.environ.get("MALLOC_MMAP_THRESHOLD_") else _mallopt()
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold) == 1


def limit_malloc_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """At most `arenas` malloc arenas from now on; False where not applied (the environment already
    sets MALLOC_ARENA_MAX, or the C library is not glibc)."""
    mallopt = None if os.environ.get("MALLOC_ARENA_MAX") else _mallopt()
    if mallopt is None:
        return False
    applied = mallopt(M_ARENA_MAX, arenas) == 1
    if not applied:
        logger.warning("could not limit malloc arenas to %d; memory may grow with fragmentation", arenas)
    return applied
