"""/metrics for the compressor's caches: what each budget share holds now and its bound, read at
scrape time, so an operator (and `make soak-hostile`) can tell a cache filling to its bound from
memory that nothing bounds."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ctxgate.compression.store.cache import cache_usage


class CompressionCacheCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = GaugeMetricFamily(
            "ctxgate:compression_cache_bytes",
            "bytes the compressor's caches of one budget share hold (keys and values, as accounted)",
            labels=["cache"],
        )
        limit = GaugeMetricFamily(
            "ctxgate:compression_cache_limit_bytes",
            "the bound of one budget share's caches (its share of compression_cache_mb, per instance)",
            labels=["cache"],
        )
        entries = GaugeMetricFamily(
            "ctxgate:compression_cache_entries", "entries in one budget share's caches", labels=["cache"]
        )
        for usage in cache_usage():
            held.add_metric([usage.name], usage.held_bytes)
            limit.add_metric([usage.name], usage.limit_bytes)
            entries.add_metric([usage.name], usage.entries)
        yield from (held, limit, entries)
