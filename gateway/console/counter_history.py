"""Counters over a chosen range: samples of the gateway's Prometheus counters, taken every minute.

A range's figure is the counter now minus its value at the newest sample taken at or before the
range's start; without such a sample (a gateway younger than the range) the range starts with the
process, where every counter was zero. Kept per process (replicas each count their own requests).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

Labels = tuple[tuple[str, str], ...]
# metric name -> labels -> value
Snapshot = dict[str, dict[Labels, float]]

SAMPLE_INTERVAL_S = 60.0
KEEP_S = 7 * 86400
RANGES: dict[str, float | None] = {"15m": 900, "1h": 3600, "24h": 86400, "7d": 7 * 86400, "all": None}


def read_counters(registry: CollectorRegistry, names: Iterable[str]) -> Snapshot:
    """The `_total` samples of these counters, by their labels."""
    wanted = set(names)
    snapshot: Snapshot = {name: {} for name in wanted}
    for family in registry.collect():
        if family.name not in wanted:
            continue
        for sample in family.samples:
            if sample.name == f"{family.name}_total":
                snapshot[family.name][tuple(sorted(sample.labels.items()))] = sample.value
    return snapshot


@dataclass(frozen=True)
class Window:
    """Counter increases over a range, from `start` (None: since the process started) to `end`."""

    start: float | None
    end: float
    values: Snapshot


class CounterHistory:
    def __init__(
        self,
        read: Callable[[], Snapshot],
        clock: Callable[[], float] = time.time,
        keep: int = int(KEEP_S // SAMPLE_INTERVAL_S) + 1,
    ):
        self._read = read
        self._clock = clock
        self._samples: deque[tuple[float, Snapshot]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def sample(self) -> None:
        moment, values = self._clock(), self._read()
        with self._lock:
            self._samples.append((moment, values))

    def window(self, seconds: float | None) -> Window:
        now, current = self._clock(), self._read()
        base: tuple[float, Snapshot] | None = None
        if seconds is not None:
            with self._lock:
                for moment, values in reversed(self._samples):
                    if moment <= now - seconds:
                        base = (moment, values)
                        break
        if base is None:
            return Window(None, now, current)
        start, before = base
        delta = {
            name: {labels: value - before.get(name, {}).get(labels, 0.0) for labels, value in series.items()}
            for name, series in current.items()
        }
        return Window(start, now, delta)
