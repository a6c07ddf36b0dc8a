"""Graceful shutdown for `ctxgate serve`: SIGTERM drains, a second signal stops at once.

On the first SIGTERM/SIGINT the gateway keeps listening but answers every new generation request
with 503 + Retry-After (and /ready with 503, so a load balancer takes it out of rotation), lets the
requests already admitted finish for at most `drain_timeout_s`, then stops as uvicorn does.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from ctxgate.gateway.admission import AdmissionController

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: AdmissionController, drain_timeout_s: float):
        super().__init__(config)
        self.admission = admission
        self.drain_timeout_s = drain_timeout_s
        self._drain_requested = False
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)  # second signal: stop now
            return
        # Only a flag here: the drain starts on the event loop (signal handlers may run mid-callback).
        self._drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.drain_timeout_s
            self.admission.start_draining()
            logger.info(
                "draining: refusing new requests, waiting up to %gs for %d in flight",
                self.drain_timeout_s,
                self.admission.in_flight,
            )
        if self._drain_deadline is not None and not self.should_exit:
            if self.admission.in_flight == 0:
                logger.info("drained; shutting down")
                self.should_exit = True
            elif time.monotonic() > self._drain_deadline:
                logger.warning(
                    "drain timeout: %d requests still in flight are cut off", self.admission.in_flight
                )
                self.should_exit = True
        return await super().on_tick(counter)
