"""Waiting for a condition instead of sleeping a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def eventually(
    condition: Callable[[], T],
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
    message: str | Callable[[], str] = "condition not met",
) -> T:
    """Poll `condition` until it returns something truthy and return that; AssertionError after
    `timeout_s`. An exception the condition raises ends the wait at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s:g}s: {message() if callable(message) else message}")
        time.sleep(interval_s)


def wait_until_engine_idle(engine: Any, timeout_s: float = 60.0) -> None:
    """No request running or waiting and every KV block back in the pool (cached blocks count as free)."""

    def idle() -> bool:
        stats = engine.stats()
        return (
            stats.num_running == 0
            and stats.num_waiting == 0
            and stats.num_kv_blocks_free == stats.num_kv_blocks_total
        )

    eventually(
        idle, timeout_s=timeout_s, message=lambda: f"engine not idle / KV blocks leaked: {engine.stats()}"
    )
