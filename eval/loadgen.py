"""Load generators for the benchmarks and the reliability tests: a closed loop (N clients, each
sending its next request when its previous one is answered) and an open loop (requests sent at
given times, whether or not earlier ones were answered). Both call `one(item)` per item and return
the results in the items' order."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


async def closed_loop(
    items: Sequence[Item],
    concurrency: int,
    one: Callable[[Item], Awaitable[Result]],
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """`concurrency` clients take the items in order, each the next one when its previous request
    finished; `on_result` sees each result as it comes (a progress bar)."""
    pending = list(enumerate(items))
    results: list[Any] = [None] * len(items)

    async def client() -> None:
        while pending:
            index, item = pending.pop(0)
            results[index] = await one(item)
            if on_result is not None:
                on_result(results[index])

    await asyncio.gather(*(client() for _ in range(max(1, concurrency))))
    return results


def poisson_offsets(count: int, rate_per_s: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds from the start) of `count` requests; the same for a given seed,
    so every arm of a benchmark can be offered the same schedule."""
    rng = random.Random(seed)
    offsets, at = [], 0.0
    for _ in range(count):
        offsets.append(at)
        at += rng.expovariate(rate_per_s)
    return offsets


def uniform_offsets(count: int, rate_per_s: float) -> list[float]:
    """Arrival times at a fixed interval of 1 / `rate_per_s`."""
    return [index / rate_per_s for index in range(count)]


async def open_loop(
    items: Sequence[Item],
    offsets: Sequence[float],
    one: Callable[[Item], Awaitable[Result]],
    max_outstanding: int | None = None,
) -> list[Result]:
    """Send each item at its offset (seconds from now) without waiting for earlier replies; at most
    `max_outstanding` in flight when given (a late item then waits for a free place)."""
    started = time.perf_counter()
    outstanding = asyncio.Semaphore(max_outstanding) if max_outstanding else None

    async def send(item: Item) -> Result:
        if outstanding is None:
            return await one(item)
        async with outstanding:
            return await one(item)

    tasks = []
    for item, offset in zip(items, offsets, strict=True):
        await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(send(item)))
    return list(await asyncio.gather(*tasks))
