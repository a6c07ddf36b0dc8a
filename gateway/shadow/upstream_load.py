"""An HTTP upstream's load for the shadow idle rule, read from its Prometheus `/metrics`: the queue
(`vllm:num_requests_waiting`, SGLang's `sglang:num_queue_reqs`, or a ctxgate server's
`ctxgate:num_requests_waiting`) and, where it says, its KV cache use.

Scraped once a second by a task that starts with the first sampled request (a gateway that shadows
nothing never scrapes). The load is known while the last successful scrape is at most
`STALE_AFTER_S` old and showed a queue; otherwise it is unknown, and the policy's
`upstream_fixed_rate` applies (gateway/shadow/runner.py). Several URLs: their queues add up and the
fullest KV cache counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ctxgate.backend.routing.upstream import UpstreamConfig
from ctxgate.policies.shadow import ShadowPolicy

logger = logging.getLogger(__name__)

QUEUE_METRICS = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "ctxgate:num_requests_waiting")
KV_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "ctxgate:kv_cache_usage_perc",
)
INTERVAL_S = 1.0
STALE_AFTER_S = 5.0
MAX_METRICS_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class UpstreamReading:
    waiting: float
    kv_usage: float | None
    at: float  # monotonic


def parse_load(text: str) -> tuple[float, float | None] | None:
    """(requests waiting, KV cache use or None) from a /metrics text; None when it shows no queue."""
    waiting: dict[str, float] = {}
    kv: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in QUEUE_METRICS:
            waiting[family.name] = sum(sample.value for sample in family.samples)
        elif family.name in KV_METRICS and family.samples:
            kv[family.name] = max(sample.value for sample in family.samples)
    queue = next((waiting[name] for name in QUEUE_METRICS if name in waiting), None)
    if queue is None:
        return None
    return queue, next((kv[name] for name in KV_METRICS if name in kv), None)


class ScrapedLoad:
    def __init__(self, config: UpstreamConfig, clock: Callable[[], float] = time.monotonic):
        self.urls = [f"{url.removesuffix('/v1')}/metrics" for url in config.urls]
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.timeout_s = config.connect_timeout_s
        self.clock = clock
        self.reading: UpstreamReading | None = None
        self._task: asyncio.Task[None] | None = None

    def known(self) -> bool:
        self._start()
        return self.reading is not None and self.clock() - self.reading.at <= STALE_AFTER_S

    def busy(self, policy: ShadowPolicy) -> bool:
        reading = self.reading
        if reading is None:
            return True
        return reading.waiting > 0 or (
            reading.kv_usage is not None and reading.kv_usage >= policy.max_kv_usage
        )

    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._scrape_forever(), name="shadow-load")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _scrape_forever(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as client:
            while True:
                await self.scrape(client)
                await asyncio.sleep(INTERVAL_S)

    async def scrape(self, client: httpx.AsyncClient) -> None:
        readings = [
            reading
            for reading in await asyncio.gather(*(self._read(client, url) for url in self.urls))
            if reading
        ]
        if len(readings) < len(self.urls):
            return  # one upstream unread: its load is unknown, the last reading goes stale
        kv = [usage for _, usage in readings if usage is not None]
        self.reading = UpstreamReading(sum(w for w, _ in readings), max(kv) if kv else None, self.clock())

    async def _read(self, client: httpx.AsyncClient, url: str) -> tuple[float, float | None] | None:
        try:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    return None
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_METRICS_BYTES:
                        return None
            return parse_load(body.decode("utf-8", "replace"))
        except (httpx.HTTPError, ValueError):
            logger.debug("reading %s for the shadow load failed", url, exc_info=True)
            return None
