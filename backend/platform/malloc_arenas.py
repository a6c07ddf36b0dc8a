"""Few glibc malloc arenas for a serving process, so freed request memory is reused, not hoarded.

glibc gives threads that allocate at the same time arenas of their own, up to eight per core. A
server's threads (event loop, engine, compression workers, embedder batcher, tokenizer pools) each
handle 100k to 1M-character bodies in turn; what one frees stays in its arena as free space that the
others cannot use, so the process's resident memory rises with every arena that has held a big
request and keeps rising as the arenas fragment. Two arenas keep that free space shared and small
(docs/deploying.md, "Memory").

Set at process start, before the threads allocate (glibc fixes its arena limit when the ninth arena
would be made). `MALLOC_ARENA_MAX` in the environment, read by glibc itself, wins: an operator can
still choose. Anywhere but glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

SERVER_ARENAS = 2
M_ARENA_MAX = -8  # glibc's mallopt parameter number


def limit_malloc_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """At most `arenas` malloc arenas from now on; False where not applied (the environment already
    sets MALLOC_ARENA_MAX, or the C library is not glibc)."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = mallopt(M_ARENA_MAX, arenas) == 1
    if not applied:
        logger.warning("could not limit malloc arenas to %d; memory may grow with fragmentation", arenas)
    return applied
