"""Whether the engine has idle capacity for a shadow request now.

The in-process engine reports its queue and KV cache after every step (`AsyncEngine.stats()`): idle
means no request waiting and the KV cache under the policy's `max_kv_usage`. An HTTP upstream's
load is read from its /metrics (gateway/shadow/upstream_load.py). An engine that reports nothing (a
model list, an upstream without a queue metric) has an unknown load: shadowing then follows the
policy's `upstream_fixed_rate` instead of `sample_rate`.
"""

from __future__ import annotations

from typing import Protocol

from ctxgate.backend.routing.upstream import UpstreamClient
from ctxgate.gateway.engine_load import StatsSource
from ctxgate.gateway.shadow.upstream_load import ScrapedLoad
from ctxgate.policies.shadow import ShadowPolicy


class ShadowLoad(Protocol):
    def known(self) -> bool:
        """True when `busy` reads the engine's real state (called from the event loop)."""
        ...

    def busy(self, policy: ShadowPolicy) -> bool:
        """True when a shadow request would compete with real work now."""
        ...

    async def close(self) -> None: ...


class EngineIdle:
    def __init__(self, source: StatsSource):
        self.source = source

    def known(self) -> bool:
        return True

    async def close(self) -> None:
        return None

    def busy(self, policy: ShadowPolicy) -> bool:
        stats = self.source.stats()
        return stats.num_waiting > 0 or stats.kv_cache_usage >= policy.max_kv_usage


class UnknownLoad:
    def known(self) -> bool:
        return False

    async def close(self) -> None:
        return None

    def busy(self, policy: ShadowPolicy) -> bool:
        return False


def load_for(engine: object) -> ShadowLoad:
    if isinstance(engine, StatsSource):
        return EngineIdle(engine)
    if isinstance(engine, UpstreamClient):
        return ScrapedLoad(engine.config)
    return UnknownLoad()
