"""Keep one OpenMP thread team per process: the engine thread's.

libgomp counts the threads of every team in the process; once they outnumber the cores it
"throttles" spinning, so workers sleep between parallel regions and every matmul pays a futex
wake-up. A second team appears as soon as another thread (the model-loading main thread, the
event loop running compression) runs a multi-threaded torch op, and the engine's decode steps slow
by about half (docs/decisions/openmp-one-team.md).

So the thread that hands the cores to the engine releases its own team and limits itself to one
OpenMP thread (its torch ops then run inline). OpenMP settings are per thread, so the engine
thread keeps its configured thread count.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1


@cache
def _libgomp() -> ctypes.CDLL | None:
    # torch's CPU wheel bundles libgomp.so.1; dlopen by that soname returns the copy torch loaded.
    try:
        library = ctypes.CDLL("libgomp.so.1")
        library.omp_set_num_threads.argtypes = [ctypes.c_int]
        library.omp_pause_resource_all.argtypes = [ctypes.c_int]
        library.omp_pause_resource_all.restype = ctypes.c_int
        return library
    except (OSError, AttributeError):
        return None


def hand_cores_to_engine() -> bool:
    """Release the calling thread's OpenMP team and limit it to one thread; False if not libgomp."""
    library = _libgomp()
    if library is None or "OpenMP" not in torch.__config__.parallel_info():
        return False
    torch.get_num_threads()  # ATen sets a thread's OpenMP count lazily once; let it happen first
    library.omp_set_num_threads(1)
    if library.omp_pause_resource_all(OMP_PAUSE_SOFT) != 0:
        logger.debug("omp_pause_resource_all refused; the calling thread's team stays")
        return False
    return True


def limit_calling_thread(num_threads: int) -> bool:
    """Give the calling thread at most `num_threads` OpenMP threads (1: its torch ops run inline and
    it never starts a team of its own that would make libgomp throttle the engine's). Per thread:
    the engine thread's own setting is untouched. False if torch does not use libgomp."""
    library = _libgomp()
    if library is None or "OpenMP" not in torch.__config__.parallel_info():
        return False
    torch.get_num_threads()  # let ATen's lazy per-thread initialisation happen before we override it
    library.omp_set_num_threads(max(1, num_threads))
    return True
