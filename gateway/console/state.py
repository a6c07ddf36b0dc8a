"""What the console keeps for the app's life: its admin key, sessions, counter history, templates."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ctxgate.gateway.console.admin_key import AdminKey
from ctxgate.gateway.console.counter_history import SAMPLE_INTERVAL_S, CounterHistory
from ctxgate.gateway.console.session import Sessions
from ctxgate.gateway.console.templates import Templates

logger = logging.getLogger(__name__)


@dataclass
class Console:
    admin_key: AdminKey
    sessions: Sessions
    history: CounterHistory
    templates: Templates
    clock: Callable[[], float]

    async def sample_forever(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        """Sample the counters every interval (the lifespan runs this while the console is on)."""
        while True:
            try:
                self.history.sample()
            except Exception:  # a failed sample loses one point of the ranges, never the console
                logger.exception("console: sampling the counters failed")
            await asyncio.sleep(interval_s)
