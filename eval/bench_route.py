"""`ctxgate bench route`: routing strategies of a model group over real engine processes.

Starts `--replicas` `ctxgate engine serve --num-threads 1` processes (a small KV pool each, so a
replica cannot hold every conversation) and runs the same open-loop schedules (eval/route_workloads.py)
under each strategy: round robin, least outstanding and cache affinity. `--via gateway` (the
default): through a real `ctxgate serve` process whose model list fronts the replicas with the arm's
strategy (eval/route_gateway.py), over HTTP; `--via in-process`: through a model group
(backend/routing/model_group.py) in this process, with the gateway's affinity key (gateway/affinity.py). Per arm and workload:
prefix-cache hit tokens summed over the replicas (the change of their
`ctxgate:prefix_cache_hits_total`), TTFT P50/P95 as the client sees it, requests/s. A last run
repeats the multi-turn workload under affinity and SIGKILLs one replica half-way: a request that
fails before its first token counts as lost (the bar is none).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx

from ctxgate.backend.engine.api import GenerationRequest, SamplingParams
from ctxgate.backend.routing.deployment_health import DeploymentHealth, HealthPolicy
from ctxgate.backend.routing.deployment_metrics import DeploymentMetrics
from ctxgate.backend.routing.model_group import Deployment, ModelGroup
from ctxgate.backend.routing.strategies import Strategy, make_router
from ctxgate.backend.routing.upstream import UpstreamClient, UpstreamConfig
from ctxgate.eval.route_gateway import GatewayFront
from ctxgate.eval.route_workloads import Item, multi_turn, rag
from ctxgate.eval.server import free_port, wait_until_ok
from ctxgate.eval.stats import percentiles
from ctxgate.gateway.affinity import affinity_key

ARMS: dict[str, Strategy] = {
    "round robin": "weighted_round_robin",
    "least outstanding": "least_outstanding",
    "affinity": "cache_affinity",
}
HITS = re.compile(r"^ctxgate:prefix_cache_hits_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.MULTILINE)
AFFINITY_PREFIX_CHARS = 2048
KV_BLOCKS = re.compile(r"^ctxgate:num_kv_blocks_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.MULTILINE)
BLOCK_TOKENS = 16  # the engine's KV block (EngineConfig.block_size): the unit a prefix cache hits in


@dataclass(frozen=True)
class RouteBenchConfig:
    replicas: int = 2
    conversations: int = 8
    turns: int = 4
    turn_gap_s: float = 6.0
    conversation_every_s: float = 2.5
    rag_requests: int = 12
    rag_every_s: float = 0.8
    max_tokens: int = 8
    kv_cache_memory_mb: int = 64
    model: str | None = None
    kill: bool = True
    via: Literal["gateway", "in-process"] = "gateway"
    load_factor: float = 1.25  # cache affinity's bound (model_list[].load_factor)


@dataclass
class Outcome:
    workload: str
    sent_at: float
    ttft_s: float | None = None
    done_at: float | None = None
    error: str | None = None
    turn: int = 0
    conversation: str = ""
    # The replica's own counts, from the stream's usage (through the gateway only).
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def started(self) -> bool:
        return self.ttft_s is not None


# -- the replicas --------------------------------------------------------------------------------
class Replicas:
    """`count` engine processes, their logs in `out`."""

    def __init__(self, count: int, out: Path, config: RouteBenchConfig) -> None:
        self.urls: list[str] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        for index in range(count):
            port = free_port()
            command = [
                sys.executable,
                "-m",
                "ctxgate",
                "--log-level",
                "WARNING",
                "engine",
                "serve",
                "--port",
                str(port),
                "--num-threads",
                "1",
                "--kv-cache-memory-mb",
                str(config.kv_cache_memory_mb),
                "--max-model-len",
                "2048",
                *(["--model", config.model] if config.model else []),
            ]
            log = (out / f"engine{index}.log").open("wb")
            self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
            self.urls.append(f"http://127.0.0.1:{port}")

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        for url, process in zip(self.urls, self.processes, strict=True):
            wait_until_ok(f"{url}/health", process, f"engine {url} (see its log)", deadline)

    def hit_tokens(self) -> dict[str, float]:
        """Prefix-cache hit tokens of each replica still running."""
        hits = {}
        for url, process in zip(self.urls, self.processes, strict=True):
            if process.poll() is None:
                hits[url] = sum(float(v) for v in HITS.findall(httpx.get(f"{url}/metrics", timeout=10).text))
        return hits

    def kv_pool_tokens(self) -> dict[str, float]:
        """Each replica's KV pool in tokens: what it can keep cached across conversations."""
        pools = {}
        for url in self.urls:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            pools[url] = sum(float(v) for v in KV_BLOCKS.findall(text)) * BLOCK_TOKENS
        return pools

    def kill(self, index: int) -> None:
        self.processes[index].send_signal(signal.SIGKILL)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def hits_gained(before: dict[str, float], after: dict[str, float]) -> float:
    """Hit tokens gained over the replicas alive at the end (a killed one's counters went with it)."""
    return sum(after[url] - before.get(url, 0.0) for url in after)


class Front(Protocol):
    """Where the bench sends its requests: a model group in this process, or a gateway process."""

    async def send(self, item: Item, max_tokens: int) -> dict[str, Any]:
        """Stream one request; {"ttft_s": seconds or None, "error": text or None, ...} as the client sees it."""
        ...


class InProcessFront:
    """A model group of this process over the replicas, keyed as the gateway keys (open mode's salt aside)."""

    def __init__(self, urls: list[str], strategy: Strategy, load_factor: float = 1.25) -> None:
        self.group = group_for(urls, strategy, load_factor)

    async def start(self) -> None:
        self.group.start()
        await self.group.check_health()

    async def send(self, item: Item, max_tokens: int) -> dict[str, Any]:
        key = affinity_key("bench", item.messages, None, AFFINITY_PREFIX_CHARS)
        request = GenerationRequest(
            request_id=f"{item.workload}-{time.perf_counter_ns()}",
            prompt_token_ids=[],
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
            messages=item.messages,
            model="bench",
            route_key=key,
        )
        seen: dict[str, Any] = {"ttft_s": None, "error": None}
        sent = time.perf_counter()
        async for delta in self.group.generate(request):
            if delta.text and seen["ttft_s"] is None:
                seen["ttft_s"] = time.perf_counter() - sent
        return seen

    async def stop(self) -> None:
        await self.group.stop()


def group_for(urls: list[str], strategy: Strategy, load_factor: float = 1.25) -> ModelGroup:
    policy = HealthPolicy(failures_to_eject=1, eject_s=30, probe_interval_s=1.0)
    deployments = [
        Deployment(
            name=url,
            client=UpstreamClient(
                UpstreamConfig(urls=[url], retries=0, down_for_s=0.0, connect_timeout_s=1.0),
                served_model_name="bench",
            ),
            health_url=f"{url}/health",
            health=DeploymentHealth(policy),
        )
        for url in urls
    ]
    return ModelGroup(
        "bench", deployments, make_router(strategy, load_factor), DeploymentMetrics(), probe_interval_s=1.0
    )


# -- one schedule --------------------------------------------------------------------------------
async def _one(front: Front, item: Item, max_tokens: int, started: float) -> Outcome:
    turn = max(0, sum(message["role"] == "user" for message in item.messages) - 1)
    outcome = Outcome(item.workload, time.perf_counter() - started, turn=turn, conversation=item.conversation)
    seen: dict[str, Any] = {}
    try:
        seen = await front.send(item, max_tokens)
    except Exception as exc:  # a lost request is a result here, not a crash of the bench
        seen = {"error": f"{type(exc).__name__}: {exc}"}
    outcome.ttft_s, outcome.error = seen.get("ttft_s"), seen.get("error")
    outcome.prompt_tokens, outcome.cached_tokens = seen.get("prompt_tokens"), seen.get("cached_tokens")
    outcome.done_at = time.perf_counter() - started
    return outcome


async def run_schedule(
    front: Front, items: list[Item], max_tokens: int, at_half: Callable[[], None] | None = None
) -> list[Outcome]:
    started = time.perf_counter()
    tasks = []
    half = items[len(items) // 2].at_s if items else 0.0
    for item in items:
        if at_half is not None and item.at_s >= half:
            at_half()
            at_half = None
        await asyncio.sleep(max(0.0, started + item.at_s - time.perf_counter()))
        tasks.append(asyncio.create_task(_one(front, item, max_tokens, started)))
    return list(await asyncio.gather(*tasks))


def summarize(outcomes: list[Outcome], hit_tokens: float) -> dict[str, Any]:
    done = [o for o in outcomes if o.error is None]
    span = (max((o.done_at or 0) for o in outcomes) - min(o.sent_at for o in outcomes)) if outcomes else 0.0
    ttft = percentiles([o.ttft_s * 1000 for o in done if o.ttft_s is not None], (50, 95))
    row: dict[str, Any] = {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(done),
        "failed_before_streaming": sum(1 for o in outcomes if o.error is not None and not o.started),
        "prefix_cache_hit_tokens": hit_tokens,
        "ttft_ms_p50": ttft["p50"],
        "ttft_ms_p95": ttft["p95"],
        "requests_per_s": round(len(done) / span, 3) if span > 0 else None,
    }
    return row | by_turn(done) | previous_turn_hits(done)


def by_turn(done: list[Outcome]) -> dict[str, Any]:
    """Per turn index: prompt tokens, and the cached ones the replica reported (what explains a ratio).
    Empty when the replicas' usage was not seen (in-process)."""
    counted = [o for o in done if o.prompt_tokens is not None]
    if not counted:
        return {}
    turns: dict[str, dict[str, int]] = {}
    for o in sorted(counted, key=lambda o: o.turn):
        row = turns.setdefault(str(o.turn), {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
        row["requests"] += 1
        row["prompt_tokens"] += o.prompt_tokens or 0
        row["cached_tokens"] += o.cached_tokens or 0
    return {"by_turn": turns}


def previous_turn_hits(done: list[Outcome], block_tokens: int = BLOCK_TOKENS) -> dict[str, Any]:
    """How much of what a later turn could reuse it found: a turn's prompt starts with its previous
    turn's whole prompt, so that (in whole KV blocks) is the most a prefix cache can give it. `full`:
    turns that found all of it (served where the previous turn was, its blocks still cached);
    `partial`: some (an older turn's replica, or blocks evicted); `none`. Empty without the replicas'
    counts, or without later turns."""
    by_conversation: dict[str, list[Outcome]] = {}
    for o in done:
        if o.prompt_tokens is not None and o.cached_tokens is not None:
            by_conversation.setdefault(o.conversation, []).append(o)
    hittable = found = 0
    kinds = {"full": 0, "partial": 0, "none": 0}
    for turns in by_conversation.values():
        turns.sort(key=lambda o: o.turn)
        for earlier, later in zip(turns, turns[1:], strict=False):
            if later.turn != earlier.turn + 1:
                continue
            reusable = (earlier.prompt_tokens or 0) // block_tokens * block_tokens
            cached = later.cached_tokens or 0
            hittable += reusable
            found += min(cached, reusable)
            kinds["full" if cached >= reusable else "partial" if cached > 0 else "none"] += 1
    if hittable == 0:
        return {}
    return {
        "previous_turn": {
            "reusable_tokens": hittable,
            "found_tokens": found,
            "found_share": round(found / hittable, 3),
            "turns": kinds,
        }
    }


async def _front(
    replicas: Replicas, strategy: Strategy, config: RouteBenchConfig, out: Path
) -> GatewayFront | InProcessFront:
    if config.via == "in-process":
        front = InProcessFront(replicas.urls, strategy, config.load_factor)
        await front.start()
        return front
    gateway = GatewayFront(replicas.urls, strategy, out, config.model, config.load_factor)
    try:
        await asyncio.to_thread(gateway.wait_ready)
    except BaseException:
        gateway.stop()
        raise
    return gateway


async def _stop(front: GatewayFront | InProcessFront) -> None:
    if isinstance(front, GatewayFront):
        await front.aclose()
        await asyncio.to_thread(front.stop)
    else:
        await front.stop()


async def _arm(
    replicas: Replicas,
    strategy: Strategy,
    workloads: dict[str, list[Item]],
    config: RouteBenchConfig,
    out: Path,
    kill_half: bool = False,
) -> dict[str, Any]:
    front = await _front(replicas, strategy, config, out)
    max_tokens = config.max_tokens
    results = {}
    routed_before: dict[str, float] = {}
    try:
        for name, items in workloads.items():
            before = await asyncio.to_thread(replicas.hit_tokens)
            outcomes = await run_schedule(
                front, items, max_tokens, (lambda: replicas.kill(0)) if kill_half else None
            )
            results[name] = summarize(
                outcomes, hits_gained(before, await asyncio.to_thread(replicas.hit_tokens))
            )
            if isinstance(front, GatewayFront):
                routed = await asyncio.to_thread(front.routing_counts)
                results[name]["gateway"] = {k: v - routed_before.get(k, 0.0) for k, v in routed.items()}
                routed_before = routed
            if kill_half:
                results[name]["errors"] = sorted({o.error or "" for o in outcomes if o.error})[:5]
    finally:
        await _stop(front)
    return results


def _workloads(config: RouteBenchConfig, tag: str) -> dict[str, list[Item]]:
    return {
        "multi-turn": multi_turn(
            tag, config.conversations, config.turns, config.turn_gap_s, config.conversation_every_s
        ),
        "rag": rag(tag, config.rag_requests, config.rag_every_s),
    }


async def _run(config: RouteBenchConfig, replicas: Replicas, out: Path) -> dict[str, Any]:
    arms = {}
    for label, strategy in ARMS.items():
        arms[label] = await _arm(replicas, strategy, _workloads(config, label), config, out)
    report: dict[str, Any] = {
        "config": asdict(config),
        "replicas": replicas.urls,
        "kv_pool_tokens": await asyncio.to_thread(replicas.kv_pool_tokens),
        "arms": arms,
    }
    if config.kill:
        kill_items = {"multi-turn": _workloads(config, "kill")["multi-turn"]}
        report["kill"] = await _arm(replicas, "cache_affinity", kill_items, config, out, kill_half=True)
    report["bars"] = bars(report)
    return report


def bars(report: dict[str, Any]) -> dict[str, Any]:
    """The acceptance bars: affinity >= 2x round robin's hit tokens and a lower TTFT P95 on the
    multi-turn workload; no request lost before streaming with a replica killed."""
    rr, affinity = report["arms"]["round robin"]["multi-turn"], report["arms"]["affinity"]["multi-turn"]
    hits_ratio = affinity["prefix_cache_hit_tokens"] / max(1.0, rr["prefix_cache_hit_tokens"])
    out: dict[str, Any] = {
        "hit_tokens_ratio": round(hits_ratio, 2),
        "hit_tokens_2x": hits_ratio >= 2,
        "ttft_p95_lower": (affinity["ttft_ms_p95"] or 0) < (rr["ttft_ms_p95"] or 0),
    }
    if "kill" in report:
        out["lost_before_streaming"] = report["kill"]["multi-turn"]["failed_before_streaming"]
    return out


def run_bench_route(config: RouteBenchConfig, out: str | Path) -> dict[str, Any]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    replicas = Replicas(config.replicas, out, config)
    try:
        replicas.wait_ready()
        report = asyncio.run(_run(config, replicas, out))
    finally:
        replicas.stop()
    (out / "route.json").write_text(json.dumps(report, indent=2))
    (out / "route.md").write_text(render_markdown(report))
    return report


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "| strategy | workload | requests | failed | prefix-cache hit tokens | TTFT P50 ms | TTFT P95 ms | req/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    runs = [(label, arm) for label, arm in report["arms"].items()]
    if "kill" in report:
        runs.append(("affinity, 1 replica killed", report["kill"]))
    for label, arm in runs:
        for workload, row in arm.items():
            lines.append(
                f"| {label} | {workload} | {row['requests']} | {row['failed']} "
                f"({row['failed_before_streaming']} before streaming) | {row['prefix_cache_hit_tokens']:.0f} | "
                f"{row['ttft_ms_p50']} | {row['ttft_ms_p95']} | {row['requests_per_s']} |"
            )
    lines += _reuse_table(runs)
    lines.append("")
    lines.append("Bars: " + json.dumps(report["bars"]))
    return "\n".join(lines) + "\n"


def _reuse_table(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """How much of each later turn's reusable prefix (its previous turn's prompt) it found."""
    rows = [
        (label, workload, row)
        for label, arm in runs
        for workload, row in arm.items()
        if "previous_turn" in row
    ]
    if not rows:
        return []
    lines = [
        "",
        "| strategy | workload | reusable tokens | found | share | turns full / partial / none | "
        "to ring owner / routed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, workload, row in rows:
        reuse, turns, routed = row["previous_turn"], row["previous_turn"]["turns"], row.get("gateway")
        owner = f"{routed['served_by_ring_owner']:.0f} / {routed['requests']:.0f}" if routed else "-"
        lines.append(
            f"| {label} | {workload} | {reuse['reusable_tokens']} | {reuse['found_tokens']} | "
            f"{reuse['found_share']} | {turns['full']} / {turns['partial']} / {turns['none']} | {owner} |"
        )
    return lines
