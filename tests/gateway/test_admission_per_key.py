"""One key's waiting requests are capped (`max_queued_per_key`) while other keys still queue."""

from __future__ import annotations

import asyncio

import pytest

from ctxgate.gateway.admission import AdmissionController, KeyOverLimit, Overloaded, overloaded_response


async def test_a_key_at_its_queue_cap_is_refused_while_another_key_queues():
    controller = AdmissionController(max_in_flight=1, max_queued=4, queue_timeout_s=5, max_queued_per_key=1)
    await controller.acquire("a")
    waiting = asyncio.create_task(controller.acquire("a"))
    await asyncio.sleep(0)
    with pytest.raises(KeyOverLimit) as info:
        await controller.acquire("a")
    answer = overloaded_response(info.value)
    assert (answer.status_code, answer.code) == (429, "too_many_queued_requests")
    other = asyncio.create_task(controller.acquire("b"))
    await asyncio.sleep(0)
    assert controller.stats().queued == 2
    controller.release()  # the slot passes to a's waiter, in arrival order
    await waiting
    controller.release()
    await other
    assert controller.stats().queued == 0 and controller.in_flight == 1
    controller.release()
    assert controller._queued_by_key == {}  # nothing left counted for keys with nothing waiting


async def test_the_global_queue_still_answers_503():
    controller = AdmissionController(max_in_flight=1, max_queued=0, queue_timeout_s=5, max_queued_per_key=8)
    await controller.acquire("a")
    with pytest.raises(Overloaded) as info:
        await controller.acquire("b")
    assert not isinstance(info.value, KeyOverLimit)
    assert overloaded_response(info.value).status_code == 503
