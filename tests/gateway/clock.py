"""Time for quota tests: a clock the test owns, and a way to keep a burst inside one wall-clock minute.

Quota windows are aligned to the minute, so a test that counts requests in one window must know
which window they fall in. In-process gateways take a `FakeClock` (`create_app(..., clock=...)`);
`ctxgate serve` subprocesses read the wall clock, and `in_one_minute` runs the burst again on a
fresh ledger when a minute boundary cut through it, instead of sleeping to the next minute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class FakeClock:
    """Seconds since the epoch that move only when the test says so."""

    def __init__(self, start: float):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def in_one_minute(attempt: Callable[[str, int], T], ledgers: Sequence[str]) -> T:
    """`attempt(ledger, minute)` on the first of `ledgers` (tenants or keys with the same limits);
    when the wall-clock minute changed while it ran, again on the next, untouched ledger. A boundary
    comes once a minute and a burst takes seconds, so two ledgers are enough. The attempt should
    only collect what it observed; the caller asserts on the result that ran in one minute."""
    for ledger in ledgers:
        minute = int(time.time() // 60)
        result = attempt(ledger, minute)
        if int(time.time() // 60) == minute:
            return result
    raise AssertionError(f"every attempt ({len(ledgers)}) crossed a minute boundary")
