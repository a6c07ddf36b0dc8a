"""One key's waiting requests are capped (`max_queued_per_key`) while other keys still queue."""

from __future__ import annotations

import asyncio

import pytest

from ctxgate.gateway.admission import AdmissionController, KeyOverLimit, Overloaded, overloaded_response
from ctxgate.gateway.admission_shares import Admittee

A, B = Admittee("a", "tenant-a"), Admittee("b", "tenant-b")


async def test_a_key_at_its_queue_cap_is_refused_while_another_key_queues():
    controller = AdmissionController(max_in_flight=1, max_queued=4, queue_timeout_s=5, max_queued_per_key=1)
    await controller.acquire(A)
    waiting = asyncio.create_task(controller.acquire(A))
    await asyncio.sleep(0)
    with pytest.raises(KeyOverLimit) as info:
        await controller.acquire(A)
    answer = overloaded_response(info.value)
    assert (answer.status_code, answer.code) == (429, "too_many_queued_requests")
    other = asyncio.create_task(controller.acquire(B))
    await asyncio.sleep(0)
    assert controller.stats().queued == 2
    controller.release(A)  # both tenants now hold one (queued): the slot goes to the older waiter
    await waiting
    controller.release(A)
    await other
    assert controller.stats().queued == 0 and controller.in_flight == 1
    controller.release(B)
    assert controller._queued_by_key == {}  # nothing left counted for keys with nothing waiting


async def test_the_global_queue_still_answers_503():
    controller = AdmissionController(max_in_flight=1, max_queued=0, queue_timeout_s=5, max_queued_per_key=8)
    await controller.acquire(A)
    with pytest.raises(Overloaded) as info:
        await controller.acquire(B)
    assert not isinstance(info.value, KeyOverLimit)
    assert overloaded_response(info.value).status_code == 503
