"""The compression workers (compression/workers.py): each runs several compressions at once on its
own event loop, up to its limit, reports how long each waited for a slot, and refuses work once closed."""

from __future__ import annotations

import asyncio
import threading

import pytest

from compression.workers import CompressionWorkers


class Concurrency:
    """Records how many of its coroutines run at once (and on which threads)."""

    def __init__(self):
        self.running = 0
        self.peak = 0
        self.threads: set[str] = set()

    async def __call__(self, value: int) -> int:
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.threads.add(threading.current_thread().name)
        await asyncio.sleep(0.05)
        self.running -= 1
        return value * 2


async def test_a_worker_runs_its_compressions_at_once_up_to_its_limit():
    workers = CompressionWorkers(count=1, max_concurrent=3)
    probe = Concurrency()
    try:
        outcomes = await asyncio.gather(*(workers.run(probe, value) for value in range(7)))
    finally:
        workers.close()
    assert [result for result, _ in outcomes] == [value * 2 for value in range(7)]
    assert probe.peak == 3
    assert probe.threads == {"ctxgate-compress_0"}
    waits = sorted(wait_ms for _, wait_ms in outcomes)
    assert waits[2] < 40 <= waits[3], "the first three start at once, the others wait for a slot"


async def test_work_goes_to_the_least_busy_worker():
    workers = CompressionWorkers(count=2, max_concurrent=1)
    probe = Concurrency()
    try:
        await asyncio.gather(workers.run(probe, 1), workers.run(probe, 2))
    finally:
        workers.close()
    assert probe.peak == 2 and len(probe.threads) == 2


async def test_an_error_reaches_the_caller_and_the_worker_goes_on():
    async def broken() -> None:
        raise ValueError("bad request")

    async def fine() -> str:
        return "ok"

    workers = CompressionWorkers(count=1)
    try:
        with pytest.raises(ValueError, match="bad request"):
            await workers.run(broken)
        assert (await workers.run(fine))[0] == "ok"
    finally:
        workers.close()


async def test_closed_workers_refuse_new_work():
    async def fine() -> str:
        return "ok"

    workers = CompressionWorkers(count=1)
    workers.close()
    with pytest.raises(RuntimeError, match="closed"):
        await workers.run(fine)


def test_a_worker_count_below_one_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        CompressionWorkers(count=0)
