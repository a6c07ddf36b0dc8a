"""`ctxgate bench fairness`: a noisy neighbour against the built-in engine, through the real gateway.

Tenant A ("noisy") offers several times what the engine can serve, with long prompts; tenant B
("quiet") sends short prompts at a low rate. Three arms, interleaved round by round so drift on the
machine hits each alike: B alone, A and B with the engine's fair queuing on, A and B with it off
(`--no-fair-queuing`, first come, first served). Two gateway processes serve the two settings; the
keys file gives both tenants weight 1. Each segment offers the same B arrivals in every arm of a
round; at its end A's requests still open are cut off (the gateway aborts them) and the next segment
starts once the gateway is idle. The report (`fairness_report.py`) compares B's TTFT with B alone,
A's goodput with fair queuing on and off, and the prefill-token shares each tenant got.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ctxgate.eval.loadgen import poisson_offsets
from ctxgate.eval.server import GatewayProcess
from ctxgate.eval.streaming import stream_chat

ARMS = ("alone", "fair", "fifo")
NOISY, QUIET = "noisy", "quiet"
_WORDS = (
    "river mill harbour lantern orchard granite meadow signal copper ledger window valley summit "
    "thunder garden bridge candle station marble forest engine quarry market island compass winter "
    "shadow feather canyon beacon velvet anchor saddle timber glacier pepper violet cobalt walnut"
).split()


@dataclass
class FairnessOptions:
    segment_s: float = 60.0  # one arm's stretch of offered load
    rounds: int = 2  # each round runs every arm once, in turn
    overload: float = 5.0  # A's offered load, as a multiple of the measured capacity
    noisy_rate: float | None = None  # A's requests/s; None: overload x the measured capacity
    noisy_prompt_tokens: int = 2500
    quiet_rate: float = 0.2  # B's requests/s (Poisson arrivals)
    output_tokens: int = 16
    calibration_requests: int = 3
    model: str | None = None
    max_num_batched_tokens: int | None = None
    seed: int = 0
    progress: bool = True
    served_model: str = ""  # what the gateways serve (read from /v1/models at the start)


@dataclass
class Outcome:
    """One request as the client saw it; times in seconds from its segment's start."""

    tenant: str
    arm: str
    round: int
    sent_s: float
    status: str  # ok, an HTTP status, "cut" (still open at the segment's end) or "error"
    ttft_s: float | None = None
    finished_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Prompts:
    """Unique prompt texts (a fresh start each, so the prefix cache cannot serve one from another)."""

    tokenizer: Any
    prompt_tokens: int
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    count: int = 0

    def noisy(self) -> str:
        self.count += 1
        words = " ".join(self.rng.choice(_WORDS) for _ in range(self.prompt_tokens))
        ids = self.tokenizer.encode(f"Request {self.count}: summarise these notes. {words}")
        return self.tokenizer.decode(ids[: self.prompt_tokens])

    def quiet(self) -> str:
        self.count += 1
        return f"Question {self.count}: name one colour of the rainbow."


def _body(text: str, options: FairnessOptions) -> dict[str, Any]:
    return {
        "model": options.served_model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": options.output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _send(
    client: httpx.AsyncClient, url: str, text: str, options: FairnessOptions, outcome: Outcome
) -> Outcome:
    """One streamed request (`client` carries its tenant's key); the outcome is filled in."""
    started = time.perf_counter()
    try:
        timing = await stream_chat(client, url, _body(text, options))
    except asyncio.CancelledError:
        outcome.status = "cut"
        raise
    except RuntimeError as exc:
        status = re.match(r"HTTP (\d+)", str(exc))
        outcome.status = status.group(1) if status else "error"
        return outcome
    except httpx.HTTPError:
        outcome.status = "error"
        return outcome
    outcome.status = "ok"
    outcome.ttft_s = timing.ttft_s
    outcome.finished_s = outcome.sent_s + (time.perf_counter() - started)
    outcome.prompt_tokens = int(timing.usage.get("prompt_tokens", 0))
    outcome.completion_tokens = int(timing.usage.get("completion_tokens", 0))
    return outcome


async def _at(offset_s: float, started: float, coroutine_factory) -> Outcome:
    await asyncio.sleep(max(0.0, started + offset_s - time.perf_counter()))
    return await coroutine_factory()


@dataclass
class Tenants:
    """Each tenant's HTTP client, its key in the headers."""

    noisy: httpx.AsyncClient
    quiet: httpx.AsyncClient


@dataclass
class Segment:
    """One arm's run: its requests and how long A's load lasted (the goodput's denominator)."""

    outcomes: list[Outcome]
    duration_s: float


async def _segment(
    url: str,
    tenants: Tenants,
    arm: str,
    round_index: int,
    options: FairnessOptions,
    rate: float,
    prompts: Prompts,
) -> Segment:
    """One arm: B's arrivals over `segment_s` (the same in each arm of a round) and, unless alone, A's
    steady load for as long as any B request is unanswered (at least `segment_s`), so B meets the
    noise until its last request and A's goodput is measured over the whole arm."""
    quiet_offsets = [
        at
        for at in poisson_offsets(
            max(4, int(options.quiet_rate * options.segment_s * 4)),
            options.quiet_rate,
            options.seed + round_index,
        )
        if at < options.segment_s
    ] or [0.0]
    started = time.perf_counter()
    outcomes: list[Outcome] = []

    def launch(client: httpx.AsyncClient, tenant: str, offset: float, text: str) -> asyncio.Task[Outcome]:
        outcome = Outcome(tenant, arm, round_index, offset, "cut")
        outcomes.append(outcome)
        return asyncio.create_task(_at(offset, started, lambda: _send(client, url, text, options, outcome)))

    quiet = [launch(tenants.quiet, QUIET, offset, prompts.quiet()) for offset in quiet_offsets]
    noisy: list[asyncio.Task[Outcome]] = []
    if arm != "alone":
        for index in itertools.count():
            offset = index / rate
            quiet_done = all(task.done() for task in quiet)
            if offset >= options.segment_s and quiet_done:
                break
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            noisy.append(launch(tenants.noisy, NOISY, offset, prompts.noisy()))
    await asyncio.gather(*quiet)  # every B request is answered: its TTFT is the measurement
    await asyncio.sleep(max(0.0, started + options.segment_s - time.perf_counter()))
    duration_s = time.perf_counter() - started
    for task in noisy:
        task.cancel()  # A's requests still open are cut: closing the stream aborts them upstream
    await asyncio.gather(*noisy, return_exceptions=True)
    return Segment(outcomes, duration_s)


async def _wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until the gateway holds no generation request (its admission gauge reads 0)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            text = (await client.get(f"{url}/metrics")).text
            match = re.search(r"^ctxgate:admission_in_flight ([0-9.e+]+)$", text, re.MULTILINE)
            if match and float(match.group(1)) == 0:
                return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} still busy {timeout_s:g}s after the segment ended")


async def _capacity(url: str, client: httpx.AsyncClient, options: FairnessOptions, prompts: Prompts) -> float:
    """A's requests/s the engine serves back to back (one at a time: its prefill is the bottleneck)."""
    started = time.perf_counter()
    done = 0
    for _ in range(options.calibration_requests):
        outcome = await _send(
            client, url, prompts.noisy(), options, Outcome(NOISY, "calibration", 0, 0.0, "cut")
        )
        if outcome.status != "ok":
            raise RuntimeError(f"a calibration request failed: {outcome.status}")
        done += 1
    return done / (time.perf_counter() - started)


def _keys_file(directory: Path) -> dict[str, str]:
    from ctxgate.gateway.key_admin import add_key

    path = directory / "keys.yaml"
    return {tenant: add_key(path, tenant, policy="passthrough") for tenant in (NOISY, QUIET)}


def _client(key: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    return httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=600, limits=limits)


async def _run(
    urls: dict[str, str], keys: dict[str, str], options: FairnessOptions, prompts: Prompts
) -> dict[str, Any]:
    tenants = Tenants(_client(keys[NOISY]), _client(keys[QUIET]))
    try:
        models = (await tenants.quiet.get(f"{urls['fair']}/v1/models")).json()
        options.served_model = models["data"][0]["id"]
        for url in urls.values():  # the first request of a process pays for start-up work (tracing)
            await _send(
                tenants.quiet, url, prompts.quiet(), options, Outcome(QUIET, "warm-up", 0, 0.0, "cut")
            )
        capacity = await _capacity(urls["fair"], tenants.noisy, options, prompts)
        rate = options.noisy_rate or options.overload * capacity
        outcomes: list[Outcome] = []
        durations = {arm: 0.0 for arm in ARMS}
        for round_index in range(options.rounds):
            for arm in ARMS:
                url = urls["fifo" if arm == "fifo" else "fair"]
                segment = await _segment(url, tenants, arm, round_index, options, rate, prompts)
                outcomes.extend(segment.outcomes)
                durations[arm] += segment.duration_s
                await _wait_idle(url)
                if options.progress:
                    print(f"round {round_index + 1}/{options.rounds} {arm}: {_progress(segment)}", flush=True)
    finally:
        await tenants.noisy.aclose()
        await tenants.quiet.aclose()
    return {
        "capacity_rps": capacity,
        "noisy_rate": rate,
        "arm_seconds": durations,
        "outcomes": [asdict(o) for o in outcomes],
    }


def _progress(segment: Segment) -> str:
    counts: dict[str, int] = {}
    for outcome in segment.outcomes:
        name = f"{outcome.tenant}:{outcome.status}"
        counts[name] = counts.get(name, 0) + 1
    listed = ", ".join(f"{name} {count}" for name, count in sorted(counts.items()))
    return f"{listed} in {segment.duration_s:.0f} s"


def run_bench_fairness(options: FairnessOptions, out_dir: str | Path, command: str = "") -> dict[str, Any]:
    """Start the two gateways, run the interleaved arms, write bench_fairness.json and .md."""
    from ctxgate.backend.model.model_prepare import resolve_model_path
    from ctxgate.backend.model.tokenizer import load_tokenizer
    from ctxgate.eval.fairness_report import render_markdown, summarize

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = Prompts(load_tokenizer(str(resolve_model_path(options.model))), options.noisy_prompt_tokens)
    engine_args = ["--default-policy", "passthrough"]
    if options.max_num_batched_tokens is not None:
        engine_args += ["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
    with tempfile.TemporaryDirectory(prefix="ctxgate-fairness-") as scratch:
        keys = _keys_file(Path(scratch))
        common = ["--keys-file", str(Path(scratch) / "keys.yaml"), *engine_args]
        fair = GatewayProcess(model=options.model, log_path=out / "gateway-fair.log", extra_args=common)
        fifo = GatewayProcess(
            model=options.model, log_path=out / "gateway-fifo.log", extra_args=[*common, "--no-fair-queuing"]
        )
        with fair as fair_url, fifo as fifo_url:
            raw = asyncio.run(_run({"fair": fair_url, "fifo": fifo_url}, keys, options, prompts))
    report = summarize(raw, options)
    report["command"] = command
    (out / "bench_fairness.json").write_text(json.dumps(report, indent=2))
    (out / "bench_fairness.md").write_text(render_markdown(report))
    return report
