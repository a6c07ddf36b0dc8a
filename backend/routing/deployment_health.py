"""Whether a deployment of a model group should get requests: passive ejection after consecutive
failures, active probes of its health endpoint, and recovery.

A deployment that fails `failures_to_eject` requests in a row (connection refused, 5xx, timeout) is
ejected for `eject_s`, doubled on each ejection in a row up to `max_eject_s`. When the time is up it
is tried again (half-open): a success clears its record, a failure ejects it again at once. The
prober ejects a deployment whose health endpoint does not answer 200 and lifts the ejection of one
that answers again, so recovery does not wait for the timer or for a client request to risk it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class HealthPolicy:
    failures_to_eject: int = 3
    eject_s: float = 5.0
    max_eject_s: float = 60.0
    probe_interval_s: float = 5.0  # 0: no active probes


class DeploymentHealth:
    """One deployment's record. `clock` is time.monotonic unless a test passes its own."""

    def __init__(self, policy: HealthPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self.consecutive_failures = 0
        self.ejected_until = 0.0
        self.ejections = 0  # in a row: sets the next ejection's length
        self.total_ejections = 0

    def available(self) -> bool:
        return self.clock() >= self.ejected_until

    def success(self) -> None:
        self.consecutive_failures = 0
        self.ejections = 0

    def failure(self) -> bool:
        """Record a failed request; True when this ejects the deployment."""
        if not self.available():
            # Sent before the ejection (a crash cuts every stream it had at once): it says nothing new,
            # so neither another ejection nor a longer one, and it is no half-open trial.
            return False
        self.consecutive_failures += 1
        half_open = self.ejections > 0  # it was ejected and this was its trial after the timer
        if half_open or self.consecutive_failures >= self.policy.failures_to_eject:
            self._eject()
            return True
        return False

    def probe(self, healthy: bool) -> bool:
        """Record an active probe; True when it ejects the deployment."""
        if healthy:
            if not self.available():
                self.ejected_until = 0.0  # recovered: routable now, its next failure ejects again
            return False
        if not self.available():
            return False
        self._eject()
        return True

    def _eject(self) -> None:
        length = min(self.policy.max_eject_s, self.policy.eject_s * 2**self.ejections)
        self.ejected_until = self.clock() + length
        self.ejections += 1
        self.total_ejections += 1
        self.consecutive_failures = 0
