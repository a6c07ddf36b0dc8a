"""`python -m eval.gil_ab --arms TEXT`: which arms run, and the busy thread's priority drop."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from eval.gil_ab import ARMS, _busy_python, select_arms


def test_an_arms_filter_keeps_the_baseline_and_the_matching_arms():
    baseline = next(iter(ARMS))
    assert select_arms(None) == list(ARMS)
    nice_arms = select_arms("nice")
    assert nice_arms[0] == baseline
    assert [name.rsplit(" ", 1)[-1] for name in nice_arms[1:]] == ["5", "10", "19"]
    assert all(ARMS[name].get("busy_nice", 0) > 0 for name in nice_arms[1:])
    assert select_arms("no such arm") == [baseline]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_the_busy_thread_lowers_its_own_priority_only():
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []
    stop = threading.Event()
    done = [0]

    def busy_then_report() -> None:
        stop.set()  # no splitting: only the priority drop runs
        _busy_python(stop, done, nice=7)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=busy_then_report)
    thread.start()
    thread.join(60)
    assert seen == [min(19, caller + 7)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
