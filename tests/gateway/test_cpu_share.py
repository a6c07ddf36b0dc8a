"""A tenant's share of the gateway's CPU (gateway/cpu_share.py): the credit, and the meter of a
request's event-loop steps."""

from __future__ import annotations

import asyncio
import time

import pytest

from ctxgate.gateway.cpu_share import TenantCpuShare, metered


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_in_debt_waits_only_while_another_tenant_has_requests_open():
    clock = Clock()
    share = TenantCpuShare(share=0.25, burst_s=0.05, clock=clock)
    share.opened("a")
    share.opened("b")
    share.charge("a", 0.55)  # 0.5 s beyond its burst
    share.closed("b")
    assert share.wait_s("a") == 0  # alone on the gateway: never held back
    share.opened("b")
    assert share.wait_s("a") == pytest.approx(0.5 / 0.25)
    assert share.wait_s("b") == 0  # b has its whole credit
    clock.now += 1.0  # a second refills a quarter second
    assert share.wait_s("a") == pytest.approx(0.25 / 0.25)
    share.closed("b")
    assert share.wait_s("a") == 0


def test_a_tenant_alone_runs_into_no_debt():
    share = TenantCpuShare(share=0.25, burst_s=0.05, clock=Clock())
    share.opened("a")
    share.charge("a", 10.0)  # nobody else was there to be slowed
    share.opened("b")
    assert share.wait_s("a") == 0
    share.charge("a", 0.5)  # now b is
    assert share.wait_s("a") == pytest.approx(0.5 / 0.25)


def test_busy_tenants_take_turns_by_who_used_less():
    share = TenantCpuShare(share=0.25, burst_s=0.05, clock=Clock())
    for tenant in ("a", "b"):
        share.opened(tenant)
    share.charge("a", 1.05)
    share.charge("b", 0.55)
    assert share.wait_s("b") == 0  # b has used less than a: it runs
    assert share.wait_s("a") == pytest.approx(0.5 / 0.25)  # a waits until level with b
    share.charge("b", 1.0)
    assert share.wait_s("a") == 0 and share.wait_s("b") > 0


def test_credit_refills_at_the_share_and_never_beyond_the_burst():
    clock = Clock()
    share = TenantCpuShare(share=0.5, burst_s=0.1, clock=clock)
    share.opened("a")
    share.opened("b")
    clock.now += 3600  # a long idle hour banks no more than the burst
    share.charge("a", 0.3)
    assert share.wait_s("a") == pytest.approx(0.2 / 0.5)
    assert share.charged_s == {"a": pytest.approx(0.3)}


@pytest.mark.parametrize("bad", [0, -0.1, 1.5])
def test_a_share_outside_zero_to_one_is_refused(bad):
    with pytest.raises(ValueError, match="share"):
        TenantCpuShare(share=bad)


def test_forgotten_tenants_are_those_with_full_credit():
    share = TenantCpuShare(share=0.25, burst_s=0.05)
    share.opened("x")
    share.charge("indebted", 1.0)
    for index in range(5000):
        share.wait_s(f"tenant-{index}")
    assert len(share._credits) <= 4096
    share.opened("y")
    assert share.wait_s("indebted") > 0  # a debt is never forgotten


def _burn(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_the_meter_counts_each_step_on_the_loop_and_not_the_waits_between():
    charged: list[float] = []

    async def request() -> str:
        _burn(0.03)
        await asyncio.sleep(0.3)  # waiting costs this tenant nothing
        _burn(0.03)
        return "done"

    assert asyncio.run(metered(request(), charged.append)) == "done"
    assert 0.05 <= sum(charged) < 0.25
    assert len(charged) >= 2


def test_the_meter_passes_cancellation_and_errors_through():
    charged: list[float] = []
    cleaned = []

    async def request() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            cleaned.append(True)

    async def cancel_it() -> None:
        task = asyncio.ensure_future(metered(request(), charged.append))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_it())
    assert cleaned == [True]

    async def failing() -> None:
        await asyncio.sleep(0)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        asyncio.run(metered(failing(), charged.append))
