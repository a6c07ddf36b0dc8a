"""The shared load generators (eval/loadgen.py): closed loop, open loop, arrival schedules."""

from __future__ import annotations

import asyncio
import time

import pytest

from ctxgate.eval.loadgen import closed_loop, open_loop, poisson_offsets, uniform_offsets


def test_poisson_offsets_are_poisson_and_the_same_for_a_seed():
    offsets = poisson_offsets(2000, rate_per_s=4.0, seed=3)
    assert offsets == poisson_offsets(2000, rate_per_s=4.0, seed=3)
    assert offsets != poisson_offsets(2000, rate_per_s=4.0, seed=4)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)  # 1 / rate
    assert max(gaps) > 3 * 0.25 > min(gaps)  # exponential gaps, not a fixed interval


def test_uniform_offsets_are_evenly_spaced():
    assert uniform_offsets(4, rate_per_s=2.0) == [0.0, 0.5, 1.0, 1.5]


async def test_open_loop_sends_on_schedule_without_waiting_for_replies():
    sent: list[float] = []
    started = time.perf_counter()

    async def one(item: int) -> int:
        sent.append(time.perf_counter() - started)
        await asyncio.sleep(0.5)  # a slow reply: a closed-loop client would wait for it
        return item * 10

    offsets = poisson_offsets(6, 50.0, seed=1)
    results = await open_loop(list(range(6)), offsets, one)
    took = time.perf_counter() - started
    assert results == [0, 10, 20, 30, 40, 50]
    assert all(abs(at - offset) < 0.1 for at, offset in zip(sorted(sent), offsets, strict=True))
    assert took < 0.5 + offsets[-1] + 0.3  # the replies overlapped: not 6 x 0.5 s


async def test_open_loop_caps_the_requests_in_flight():
    in_flight = peak = 0

    async def one(item: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        return item

    assert await open_loop(list(range(8)), [0.0] * 8, one, max_outstanding=3) == list(range(8))
    assert peak == 3


async def test_closed_loop_keeps_concurrency_clients_busy_and_the_items_order():
    in_flight = peak = 0
    seen: list[int] = []

    async def one(item: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02 * (item % 3))  # replies finish out of order
        in_flight -= 1
        return item * 2

    results = await closed_loop(list(range(9)), 3, one, on_result=seen.append)
    assert results == [item * 2 for item in range(9)]
    assert peak == 3 and sorted(seen) == results
