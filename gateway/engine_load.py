"""What the budget controller reads of the engine: prompt tokens waiting for prefill, sequences
running, KV cache use and prefill speed.

The in-process engine reports its own state (`AsyncEngine.stats()`, refreshed after every step, never
blocking on one). An HTTP upstream reports nothing here: its queue is the requests this gateway has
sent and not yet seen a first token of, and its speed what responses measured (both kept by the
controller itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ctxgate.backend.engine.engine_stats import EngineStats


@dataclass(frozen=True)
class EngineReading:
    waiting_tokens: int = 0
    running: int = 0
    kv_usage: float = 0.0
    prefill_tokens_per_s: float | None = None  # None: the engine does not say


class LoadReader(Protocol):
    def read(self) -> EngineReading: ...


@runtime_checkable
class StatsSource(Protocol):
    """An engine that reports its scheduler's state (ctxgate.backend.engine.async_engine.AsyncEngine)."""

    def stats(self) -> EngineStats: ...


class EngineStatsReader:
    def __init__(self, source: StatsSource):
        self.source = source

    def read(self) -> EngineReading:
        stats = self.source.stats()
        return EngineReading(
            waiting_tokens=stats.num_waiting_tokens,
            running=stats.num_running,
            kv_usage=stats.kv_cache_usage,
            prefill_tokens_per_s=stats.prefill_tokens_per_s or None,
        )


class NoEngineState:
    """An engine that reports nothing (an HTTP upstream): the controller's own ledger stands alone."""

    def read(self) -> EngineReading:
        return EngineReading()


def reader_for(engine: object) -> LoadReader:
    return EngineStatsReader(engine) if isinstance(engine, StatsSource) else NoEngineState()
