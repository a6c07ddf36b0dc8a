"""`ctxgate bench route --via gateway`: a real `ctxgate serve` process fronts the engine replicas.

Its config file's `model_list:` puts the replicas in one group under the arm's strategy (the only
thing that changes between arms), with the `passthrough` policy so the prompts reach the replicas as
sent; the workload is streamed to it over HTTP like any client's. What the bench measures then
includes the gateway's own work (auth, counting, the affinity key, relaying the stream) and its
health checks (probes, passive ejection), as in production.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from ctxgate.backend.routing.strategies import Strategy
from ctxgate.eval.route_workloads import Item
from ctxgate.eval.server import free_port, wait_until_ok

MODEL = "bench"
# The gateway's per-deployment counters (backend/routing/deployment_metrics.py), summed over the deployments.
ROUTING_COUNTERS = {
    "requests": "deployment_requests_total",
    "served_by_ring_owner": "deployment_affinity_hits_total",
    "ejections": "deployment_ejections_total",
}


def gateway_config(
    urls: list[str], strategy: Strategy, model: str | None, load_factor: float = 1.25
) -> dict[str, Any]:
    """One served model over the replicas; a replica that fails once is out for 30 s, probed every second."""
    config: dict[str, Any] = {
        "server": {"default_policy": "passthrough", "upstream_connect_timeout_s": 1.0, "upstream_retries": 0},
        "model_list": [
            {
                "model_name": MODEL,
                "routing": strategy,
                "load_factor": load_factor,
                "health": {"failures_to_eject": 1, "eject_s": 30, "probe_interval_s": 1.0},
                "deployments": [{"url": f"{url}/v1"} for url in urls],
            }
        ],
    }
    if model:  # the gateway counts with the replicas' tokenizer
        config["engine"] = {"model": model}
    return config


class GatewayFront:
    """A `ctxgate serve` process in front of `urls`; `send` streams one request through it."""

    def __init__(
        self,
        urls: list[str],
        strategy: Strategy,
        out: Path,
        model: str | None = None,
        load_factor: float = 1.25,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = out / f"gateway-{strategy}.yaml"
        config.write_text(yaml.safe_dump(gateway_config(urls, strategy, model, load_factor)))
        command = [
            sys.executable,
            "-m",
            "ctxgate",
            "--log-level",
            "WARNING",
            "serve",
            "--config",
            str(config),
            "--port",
            str(self.port),
        ]
        self._log = (out / f"gateway-{strategy}.log").open("wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(120.0, connect=5.0),
            limits=httpx.Limits(max_connections=256),
        )

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        wait_until_ok(
            f"{self.url}/ready", self.process, "the gateway (see its log)", time.monotonic() + timeout_s
        )

    async def send(self, item: Item, max_tokens: int) -> dict[str, Any]:
        """Stream one request: {"ttft_s", "error", "prompt_tokens", "cached_tokens"} as seen by the client."""
        body = {
            "model": MODEL,
            "messages": item.messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        seen: dict[str, Any] = {"ttft_s": None, "error": None}
        sent = time.perf_counter()
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                seen["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return seen
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                _read_event(json.loads(line[len("data: ") :]), seen, sent)
        return seen

    def routing_counts(self) -> dict[str, float]:
        """Requests the gateway routed, how many went to where their prefix was expected (the rest spilled
        under bounded load, or failed over), and ejections: summed over the deployments."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {
            name: sum(
                float(v)
                for v in re.findall(rf"^ctxgate:{metric}\{{[^}}]*\}}\s+([0-9.eE+-]+)$", text, re.MULTILINE)
            )
            for name, metric in ROUTING_COUNTERS.items()
        }

    async def aclose(self) -> None:
        await self.client.aclose()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def _read_event(event: dict[str, Any], seen: dict[str, Any], sent: float) -> None:
    if "error" in event:  # an error after the stream began (the gateway's mid-stream error event)
        seen["error"] = f"stream error: {event['error'].get('message', event['error'])}"
        return
    choices = event.get("choices") or []
    if seen["ttft_s"] is None and any((choice.get("delta") or {}).get("content") for choice in choices):
        seen["ttft_s"] = time.perf_counter() - sent
    usage = event.get("usage")
    if usage:
        seen["prompt_tokens"] = usage.get("prompt_tokens")
        seen["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
