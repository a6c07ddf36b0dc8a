"""The compression workers and the gateway's per-tenant CPU share (compression/fair.py `pacer`):
a job's CPU is charged to its tenant at its yield points, and a job over its tenant's share sleeps
there, its slot free for others, only while another tenant has requests open."""

from __future__ import annotations

import time

from ctxgate.compression.fair import FairScheduler, yield_turn
from ctxgate.gateway.cpu_share import TenantCpuShare


def _cpu_job(cpu_s: float) -> float:
    """Burn `cpu_s` of this thread's CPU with a yield point every 10 ms; its wall time."""
    started = time.perf_counter()
    until = time.thread_time() + cpu_s
    while time.thread_time() < until:
        mark = time.thread_time() + 0.01
        while time.thread_time() < mark:
            pass
        yield_turn()
    return time.perf_counter() - started


def test_a_job_over_its_share_pauses_while_another_tenant_waits():
    share = TenantCpuShare(share=0.25, burst_s=0.02)
    scheduler = FairScheduler(slots=1, pacer=share)
    share.opened("flooder")
    share.opened("victim")  # another tenant has a request open
    wall_s = scheduler.submit("flooder", _cpu_job, 0.1).result(timeout=30)
    # 0.1 s of CPU at a quarter of a core, less the burst: at least ~0.3 s of wall time.
    assert wall_s >= 0.25, wall_s
    assert scheduler.pauses >= 1
    assert share.charged_s["flooder"] >= 0.1
    scheduler.shutdown()


def test_a_tenant_alone_is_never_paused():
    share = TenantCpuShare(share=0.25, burst_s=0.02)
    scheduler = FairScheduler(slots=1, pacer=share)
    share.opened("alone")
    scheduler.submit("alone", _cpu_job, 0.1).result(timeout=30)
    assert scheduler.pauses == 0
    assert share.charged_s["alone"] >= 0.1
    scheduler.shutdown()


def test_a_paused_job_leaves_its_slot_to_another_tenant():
    share = TenantCpuShare(share=0.05, burst_s=0.01)
    scheduler = FairScheduler(slots=1, pacer=share)
    share.opened("flooder")
    share.opened("victim")
    big = scheduler.submit("flooder", _cpu_job, 0.1)
    time.sleep(0.05)  # the flooder's job runs into its debt and sleeps
    small = scheduler.submit("victim", _cpu_job, 0.001)
    small.result(timeout=10)
    assert not big.done(), "the victim's job should not wait for the paused one to finish"
    share.closed("victim")  # alone again: the flooder goes on at once
    big.result(timeout=30)
    scheduler.shutdown()


def test_time_the_engine_spent_for_a_job_is_charged_to_its_tenant():
    from ctxgate.compression.fair import charge_turn

    share = TenantCpuShare(share=0.25, burst_s=0.02)
    scheduler = FairScheduler(slots=1, pacer=share)
    share.opened("a")
    charge_turn(5.0)  # outside any job: no one to charge
    assert share.charged_s == {}
    scheduler.submit("a", charge_turn, 0.5).result(timeout=10)  # an embedding pass on the engine
    assert share.charged_s["a"] >= 0.5
    scheduler.shutdown()
