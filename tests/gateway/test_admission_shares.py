"""Admission under overload goes by the tenants' weighted shares: the tenant holding the most per unit
of weight is shed first and gets freed slots last, so a quiet tenant still gets in."""

from __future__ import annotations

import asyncio

import pytest

from ctxgate.gateway.admission import AdmissionController, Overloaded, overloaded_response
from ctxgate.gateway.admission_shares import Admittee


def flooder(weight: float = 1.0) -> Admittee:
    return Admittee("key-a", "flooder", weight)


QUIET = Admittee("key-b", "quiet")


async def queued(controller: AdmissionController, who: Admittee | None) -> asyncio.Task[None]:
    task = asyncio.create_task(controller.acquire(who))
    await asyncio.sleep(0)
    return task


async def test_a_full_queue_sheds_the_flooding_tenants_newest_waiter_for_a_quiet_one():
    controller = AdmissionController(max_in_flight=1, max_queued=3, queue_timeout_s=5)
    await controller.acquire(flooder())
    flood = [await queued(controller, flooder()) for _ in range(3)]
    quiet = await queued(controller, QUIET)  # the queue is full: the flooder's newest gives way
    with pytest.raises(Overloaded) as info:
        await flood[-1]
    answer = overloaded_response(info.value)
    assert (answer.status_code, answer.code) == (503, "overloaded")
    assert "weighted share" in str(info.value)
    assert (controller.shed, controller.rejected, controller.stats().queued) == (1, 1, 3)
    # The flooder holds 2 queued, the quiet tenant 1: the freed slot goes to the quiet one.
    controller.release(flooder())
    await quiet
    assert not flood[0].done()
    controller.release(QUIET)
    await flood[0]
    controller.release(flooder())
    await flood[1]
    controller.release(flooder())
    assert controller.in_flight == 0 and controller.shares.running("flooder") == 0


async def test_a_tenant_never_sheds_its_own_waiters_and_the_newcomer_gets_the_503():
    controller = AdmissionController(max_in_flight=1, max_queued=2, queue_timeout_s=5)
    await controller.acquire(flooder())
    flood = [await queued(controller, flooder()) for _ in range(2)]
    with pytest.raises(Overloaded):
        await controller.acquire(flooder())
    assert controller.shed == 0 and not any(task.done() for task in flood)
    for task in flood:
        controller.release(flooder())
        await task
    controller.release(flooder())


@pytest.mark.parametrize(("weight", "quiet_gets_in"), [(1.0, True), (4.0, True), (5.0, False)])
async def test_the_share_is_per_unit_of_weight(weight: float, quiet_gets_in: bool):
    # The flooder holds 5 (1 running, 4 queued): more than the quiet tenant's 1 unless its weight is 5.
    controller = AdmissionController(max_in_flight=1, max_queued=4, queue_timeout_s=5)
    await controller.acquire(flooder(weight))
    flood = [await queued(controller, flooder(weight)) for _ in range(4)]
    if quiet_gets_in:
        quiet = await queued(controller, QUIET)
        with pytest.raises(Overloaded):
            await flood.pop()
        flood.append(quiet)
    else:
        with pytest.raises(Overloaded):
            await controller.acquire(QUIET)
    assert controller.shed == int(quiet_gets_in)
    controller.start_draining()  # the waiters left get the shutdown 503
    outcomes = await asyncio.gather(*flood, return_exceptions=True)
    assert all(isinstance(outcome, Overloaded) for outcome in outcomes)


async def test_a_freed_slot_goes_to_the_tenant_with_the_lowest_load_per_weight():
    # Heavy (weight 4) holds 3 queued: 0.75 per unit; light (weight 1) holds 1: 1.0. Heavy goes first.
    controller = AdmissionController(max_in_flight=1, max_queued=4, queue_timeout_s=5)
    heavy, light = Admittee("h", "heavy", 4.0), Admittee("l", "light", 1.0)
    await controller.acquire(light)
    light_waiter = await queued(controller, light)
    heavy_waiters = [await queued(controller, heavy) for _ in range(3)]
    controller.release(light)
    await heavy_waiters[0]
    assert not light_waiter.done()
    controller.release(heavy)  # heavy: 2 queued / 4 = 0.5 against light's 1.0
    await heavy_waiters[1]
    controller.release(heavy)  # heavy: 1 / 4 = 0.25 still
    await heavy_waiters[2]
    controller.release(heavy)
    await light_waiter
    controller.release(light)
    assert controller.in_flight == 0


async def test_without_tenants_the_queue_stays_first_come_first_served():
    controller = AdmissionController(max_in_flight=1, max_queued=2, queue_timeout_s=5)
    await controller.acquire()
    first, second = await queued(controller, None), await queued(controller, None)
    with pytest.raises(Overloaded):
        await controller.acquire()
    controller.release()
    await first
    assert not second.done()
    controller.release()
    await second
    controller.release()
    assert controller.shed == 0 and controller.in_flight == 0
