"""The fair compression scheduler (compression/fair.py): tenants take turns at the workers, a long
job gives its slot up at yield points when another tenant waits, and nothing is lost or run twice."""

from __future__ import annotations

import threading
import time

import pytest

from ctxgate.compression.fair import FairScheduler, yield_turn
from tests.support.waiting import eventually


def _long_job(seconds: float, log: list[str], name: str) -> str:
    """Work in 5 ms steps with a yield point after each (as the embedder's chunks do)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        time.sleep(0.005)
        yield_turn()
    log.append(name)
    return name


def test_a_small_job_runs_while_one_long_job_holds_the_only_worker():
    scheduler = FairScheduler(slots=1, slice_s=0.02)
    log: list[str] = []
    big = scheduler.submit("b", _long_job, 2.0, log, "big")
    time.sleep(0.1)  # the big job is running
    started = time.perf_counter()
    small = scheduler.submit("c", _long_job, 0.01, log, "small")
    assert small.result(timeout=10) == "small"
    waited = time.perf_counter() - started
    assert not big.done(), "the small job should finish while the big one still runs"
    assert big.result(timeout=10) == "big"
    assert log == ["small", "big"]
    assert waited < 0.5, f"the small job waited {waited:.2f}s behind a 2 s job"
    assert scheduler.preemptions >= 1
    scheduler.shutdown()


def _gated(scheduler: FairScheduler, jobs: list[tuple[str, float]], order: list[str]) -> None:
    """Queue `jobs` (tenant, seconds) behind a third tenant's job, then let them all run."""
    gate = threading.Event()
    first = scheduler.submit("gatekeeper", gate.wait, 5)
    futures = [
        scheduler.submit(tenant, lambda t=tenant, s=seconds: (time.sleep(s), order.append(t)))
        for tenant, seconds in jobs
    ]
    gate.set()
    for future in [first, *futures]:
        future.result(timeout=10)


def test_tenants_with_equal_work_alternate_whatever_the_arrival_order():
    scheduler = FairScheduler(slots=1)
    order: list[str] = []
    _gated(scheduler, [("b", 0.03)] * 4 + [("c", 0.03)] * 4, order)
    # First come, first served would run b, b, b, b, c, c, c, c.
    for prefix in range(1, len(order) + 1):
        assert abs(order[:prefix].count("b") - order[:prefix].count("c")) <= 2, order
    scheduler.shutdown()


def test_the_tenant_that_used_less_goes_first():
    scheduler = FairScheduler(slots=1)
    order: list[str] = []
    _gated(scheduler, [("b", 0.2), ("b", 0.01), ("c", 0.01), ("c", 0.01)], order)
    # b's first job used 0.2 s: c's small ones go before b's second.
    assert order == ["b", "c", "c", "b"]
    scheduler.shutdown()


def test_a_tenant_alone_is_not_preempted_and_keeps_its_order():
    scheduler = FairScheduler(slots=1, slice_s=0.0)
    log: list[str] = []
    futures = [scheduler.submit("b", _long_job, 0.03, log, f"job{i}") for i in range(4)]
    assert [f.result(timeout=5) for f in futures] == [f"job{i}" for i in range(4)]
    assert log == [f"job{i}" for i in range(4)]
    assert scheduler.preemptions == 0
    scheduler.shutdown()


def test_slots_bound_the_jobs_running_at_once():
    scheduler = FairScheduler(slots=2, slice_s=0.0)
    running = 0
    most = 0
    lock = threading.Lock()

    def job() -> None:
        nonlocal running, most
        for _ in range(10):
            with lock:
                running += 1
                most = max(most, running)
            time.sleep(0.002)
            with lock:
                running -= 1
            yield_turn()  # parked between steps: not counted as running

    futures = [scheduler.submit(f"t{i % 4}", job) for i in range(12)]
    for future in futures:
        future.result(timeout=20)
    assert most == 2
    scheduler.shutdown()


def test_a_job_s_exception_reaches_its_caller_and_the_worker_goes_on():
    scheduler = FairScheduler(slots=1)

    def fail() -> None:
        raise ValueError("bad text")

    with pytest.raises(ValueError, match="bad text"):
        scheduler.submit("b", fail).result(timeout=5)
    assert scheduler.submit("c", lambda: 7).result(timeout=5) == 7
    scheduler.shutdown()


def test_shutdown_cancels_queued_jobs():
    scheduler = FairScheduler(slots=1)
    gate = threading.Event()
    running = scheduler.submit("b", gate.wait, 5)
    queued = scheduler.submit("c", lambda: 1)
    scheduler.shutdown()
    assert queued.cancelled()
    gate.set()
    assert running.result(timeout=5) is True
    with pytest.raises(RuntimeError, match="shut down"):
        scheduler.submit("c", lambda: 1)


def test_yield_turn_outside_a_scheduler_does_nothing():
    started = time.perf_counter()
    yield_turn()
    assert time.perf_counter() - started < 0.01


def test_tenants_with_nothing_queued_are_forgotten():
    scheduler = FairScheduler(slots=1)
    for i in range(50):
        scheduler.submit(f"tenant-{i}", lambda: None).result(timeout=5)
    assert scheduler.waiting() == {}
    # The last job's bookkeeping ends just after its result is handed over.
    eventually(lambda: len(scheduler._tenants) == 0, timeout_s=5, message="a finished tenant is still held")
    scheduler.shutdown()
