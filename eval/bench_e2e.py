"""`ctxgate bench e2e`: do the prompt tokens the gateway saves become time the user saves?

Four arms on the same questions and load, in one run:

- *full*: through the gateway with policy `passthrough`, documents attached (every token prefilled);
- *compressed*: through the gateway with the compressing policy (default `rag-default`), documents
  the gateway has never seen (a freshly started gateway per concurrency level, no shared cache), so
  the first pass pays first-sight compression; the second pass sends the same documents again (warm);
- *ideal*: the exact messages the compressing policy sends (fetched from /v1/ctxgate/compress after
  the compressed arm saw them), sent with `passthrough` (same prefill, no compression work);
- *engine*: the ideal messages sent straight to the built-in engine without the gateway: by default
  an `AsyncEngine` in the bench process (token ids in, deltas out: no HTTP at all, the strictest
  baseline), or `ctxgate engine serve` over HTTP with `--engine-server`.

With `--arrival-rate R` the load is open loop instead: each chunk's requests arrive at Poisson times
at R requests/s (the same schedule for every arm), whatever the replies; a closed loop builds convoys
that a stream of independent users does not.

Arms are interleaved chunk by chunk (a chunk is a few closed-loop "rounds" of `concurrency` clients),
the order rotated per chunk, because a shared two-core machine drifts over minutes. Every request
starts with a unique tag, so nothing is served from the prefix cache, and generates exactly
`output_tokens` tokens (ignore_eos), so arms differ only in what they prefill and what runs around it.
Every chunk records the CPU time other processes took meanwhile (eval.bench_engine.CpuMeter).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ctxgate.client import ctxgate_extra_body
from eval import loadgen, streaming
from eval.bench_engine import CpuMeter
from eval.client import ctxgate_extra, question_messages
from eval.datasets import EvalExample, load_dataset, resolve_dataset_path
from eval.loadgen import closed_loop
from eval.loadgen import poisson_offsets as arrival_offsets
from eval.stats import p95_ratio_interval, percentile

ARMS = ("full", "compressed", "ideal", "engine")
PASSES = ("cold", "warm")
# Orders the arms run in, rotated per chunk. The compressed arm always runs before ideal and engine:
# their messages are fetched after it, so the fetch never warms the gateway for the compressed arm.
ARM_ORDERS: tuple[tuple[str, ...], ...] = (
    ("full", "compressed", "ideal", "engine"),
    ("compressed", "engine", "ideal", "full"),
    ("compressed", "full", "ideal", "engine"),
    ("compressed", "ideal", "engine", "full"),
)
TAG_PLACEHOLDER = "bench-tag-000000000000"
OPEN_LOOP = 0  # the level (Sample.concurrency) of an open-loop run
OPEN_LOOP_CHUNK_CLIENTS = 4
# Open loop, requests/s is the rate the arm was offered, not what it can serve: these checks need
# the closed loop and are left undecided.
CLOSED_LOOP_ONLY_CHECKS = ("gateway_vs_engine_req_s", "efficiency", "gain")


@dataclass
class E2EOptions:
    dataset: str
    limit: int | None = None
    concurrencies: list[int] = field(default_factory=lambda: [4])
    output_tokens: int = 32
    policy: str = "rag-default"
    full_policy: str = "passthrough"
    warm_pass: bool = True
    rounds_per_chunk: int = 2
    model: str | None = None
    policy_dir: str | None = None
    progress: bool = True
    engine_server: bool = False
    embed_on: str = "engine"  # the gateway's `serve --embed-on`
    compression_workers: int | None = None  # the gateway's `serve --compression-workers`; None: its default
    compression_nice: int | None = None  # the gateway's `serve --compression-nice`; None: its default
    max_num_batched_tokens: int | None = None  # the engine's token budget per step (gateway and engine alone)
    # Open loop: requests arrive at this Poisson rate (requests/s), whether or not earlier ones have
    # finished, instead of `concurrency` clients that each wait for their last reply. One level.
    arrival_rate: float | None = None

    @property
    def levels(self) -> list[int]:
        """The concurrency levels; open loop runs one level, labelled 0 (no client count)."""
        return [OPEN_LOOP] if self.arrival_rate else self.concurrencies

    def chunk_size(self, concurrency: int) -> int:
        """Requests per interleaved chunk: open loop, as many as four closed-loop clients' chunk."""
        return max(1, (concurrency or OPEN_LOOP_CHUNK_CLIENTS) * self.rounds_per_chunk)


@dataclass
class Sample:
    """One request as the client saw it, plus what the server reported in usage."""

    arm: str
    pass_name: str
    concurrency: int
    question_id: str
    ttft_ms: float
    e2e_ms: float
    output_tokens: int
    prompt_tokens: int
    original_prompt_tokens: int | None = None
    cached_prompt_tokens: int = 0
    prefill_ms: float | None = None
    compression_ms: float | None = None
    compression_stage_ms: dict[str, float] = field(default_factory=dict)
    compression_wait_ms: float | None = None  # waiting for a compression worker (not in compression_ms)
    queue_ms: float | None = None  # the engine's queue time (incl. the wait for the step in progress)
    # Time the compression's embedding passes held the engine's thread (every running request waited).
    compression_engine_ms: float | None = None
    error: str | None = None
    # The request's place in its chunk's send order (0-based). Closed loop: the first `concurrency`
    # are sent together, each later one when an earlier request of the chunk finishes.
    position: int | None = None

    @property
    def tpot_ms(self) -> float | None:
        if self.output_tokens <= 1 or self.error:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)


@dataclass
class ArmRun:
    """One arm over one chunk: its samples, wall time and the neighbours' CPU meanwhile."""

    arm: str
    samples: list[Sample]
    wall_s: float
    others_cpu_frac: float


# ---------------------------------------------------------------------------- requests
def new_tag() -> str:
    """Same length as TAG_PLACEHOLDER: swapping one for the other keeps the prompt's length."""
    return f"bench-tag-{uuid.uuid4().hex[:12]}"


def tagged(messages: list[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    return [{**m, "content": str(m.get("content", "")).replace(TAG_PLACEHOLDER, tag)} for m in messages]


def request_body(arm: str, example: EvalExample, ideal_messages: list[dict[str, Any]] | None,
                 options: E2EOptions, model: str) -> dict[str, Any]:
    """The chat request an arm sends for one question (a fresh tag first in the system prompt)."""
    tag = new_tag()
    body: dict[str, Any] = {
        "model": model, "max_tokens": options.output_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    if arm in ("full", "compressed"):
        body["messages"] = question_messages(example, cache_buster=tag)
        policy = options.full_policy if arm == "full" else options.policy
        body |= ctxgate_extra(example, policy)
    else:
        assert ideal_messages is not None
        body["messages"] = tagged(ideal_messages, tag)
        if arm == "ideal":
            body |= ctxgate_extra_body(policy=options.full_policy)
    return body


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat completion (eval/streaming.py) as a reply: TTFT, end to end, the usage."""
    timing = await streaming.stream_chat(client, url, body)
    return {"ttft_ms": timing.ttft_s * 1000, "e2e_ms": timing.e2e_s * 1000, "usage": timing.usage}


async def local_generate(engine: Any, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """One request to an in-process `AsyncEngine`, timed like `stream_chat` (usage in the same shape)."""
    from backend.api import GenerationRequest, SamplingParams
    from backend.deltas import DeltaTotals

    started = time.perf_counter()
    ids = engine.tokenizer.encode_chat(messages)
    request = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids,
                                sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    first: float | None = None
    totals = DeltaTotals(prompt_tokens=len(ids))
    async for delta in engine.generate(request):
        if delta.token_ids and first is None:
            first = time.perf_counter()
        totals.add(delta)
    ended = time.perf_counter()
    metrics = totals.metrics
    usage = {"prompt_tokens": len(ids), "completion_tokens": totals.completion_tokens,
             "ctxgate": {"prefill_ms": metrics.prefill_ms if metrics else None,
                         "queue_ms": metrics.queue_ms if metrics else None}}
    return {"ttft_ms": ((first or ended) - started) * 1000, "e2e_ms": (ended - started) * 1000, "usage": usage}


def sample_of(arm: str, pass_name: str, concurrency: int, example: EvalExample, reply: dict[str, Any]) -> Sample:
    usage = reply["usage"]
    extra = usage.get("ctxgate") or {}
    compression = extra.get("compression_ms")
    return Sample(
        arm=arm, pass_name=pass_name, concurrency=concurrency, question_id=example.id,
        ttft_ms=reply["ttft_ms"], e2e_ms=reply["e2e_ms"],
        output_tokens=int(usage.get("completion_tokens") or 0), prompt_tokens=int(usage.get("prompt_tokens") or 0),
        original_prompt_tokens=extra.get("original_prompt_tokens"),
        cached_prompt_tokens=int(extra.get("cached_prompt_tokens") or
                                 (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        prefill_ms=extra.get("prefill_ms"),
        compression_ms=sum(float(v) for v in compression.values()) if isinstance(compression, dict) else None,
        compression_stage_ms={k: float(v) for k, v in compression.items()} if isinstance(compression, dict) else {},
        compression_wait_ms=extra.get("compression_wait_ms"),
        queue_ms=extra.get("queue_ms"),
        compression_engine_ms=extra.get("compression_engine_ms"),
    )


async def open_loop(items: Sequence[Any], rate_per_s: float, one: Callable, seed: int) -> list[Any]:
    """Send each item at its Poisson arrival time (the same schedule for every arm of a chunk)."""
    return await loadgen.open_loop(items, arrival_offsets(len(items), rate_per_s, seed), one)


# ---------------------------------------------------------------------------- the run
@dataclass
class Endpoints:
    gateway: str
    engine: str | None  # `ctxgate engine serve`, or None: `local_engine` in this process
    model: str
    server_pids: list[int]
    local_engine: Any = None


class E2ERun:
    """Runs the arms over the questions for one concurrency level against running servers."""

    def __init__(self, endpoints: Endpoints, options: E2EOptions, concurrency: int):
        self.endpoints = endpoints
        self.options = options
        self.concurrency = concurrency
        self.ideal: dict[str, list[dict[str, Any]]] = {}
        self.compress_reports: dict[str, dict[str, Any]] = {}
        self.runs: list[tuple[str, ArmRun]] = []

    async def warm_up(self, client: httpx.AsyncClient, examples: list[EvalExample]) -> None:
        """Load lazy parts (the embedder, first-call allocations) on scrambled text nobody measures."""
        from eval.bench_prefill import scrambled_copy

        for example in examples[:2]:
            copy = scrambled_copy(example)
            for arm in ("full", "compressed"):
                body = request_body(arm, copy, None, self.options, self.endpoints.model) | {"max_tokens": 2}
                await stream_chat(client, self.endpoints.gateway, body)
            await self.fetch_ideal(client, [copy])
            await self.engine_request(client, copy, max_tokens=2)

    async def engine_request(self, client: httpx.AsyncClient, example: EvalExample,
                             max_tokens: int | None = None) -> dict[str, Any]:
        """The ideal messages to the engine alone: over HTTP, or as token ids to the local engine."""
        body = request_body("engine", example, self.ideal[example.id], self.options, self.endpoints.model)
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if self.endpoints.local_engine is None:
            assert self.endpoints.engine is not None
            return await stream_chat(client, self.endpoints.engine, body)
        return await local_generate(self.endpoints.local_engine, body["messages"], body["max_tokens"])

    async def fetch_ideal(self, client: httpx.AsyncClient, examples: list[EvalExample]) -> None:
        """The messages the compressing policy sends, with a placeholder tag the arms replace."""
        for example in examples:
            if example.id in self.ideal:
                continue
            body = {"model": self.endpoints.model, "messages": question_messages(example, TAG_PLACEHOLDER),
                    **ctxgate_extra(example, self.options.policy)}
            response = await client.post(self.endpoints.gateway + "/v1/ctxgate/compress", json=body)
            response.raise_for_status()
            payload = response.json()
            self.ideal[example.id] = payload["messages"]
            self.compress_reports[example.id] = payload["report"]

    async def run_arm(self, client: httpx.AsyncClient, arm: str, pass_name: str,
                      examples: list[EvalExample], chunk_index: int = 0) -> ArmRun:
        positions = {id(example): index for index, example in enumerate(examples)}

        async def one(example: EvalExample) -> Sample:
            sample = await one_sample(example)
            sample.position = positions[id(example)]
            return sample

        async def one_sample(example: EvalExample) -> Sample:
            try:
                if arm == "engine":
                    reply = await self.engine_request(client, example)
                else:
                    body = request_body(arm, example, self.ideal.get(example.id), self.options, self.endpoints.model)
                    reply = await stream_chat(client, self.endpoints.gateway, body)
            except (httpx.HTTPError, RuntimeError) as exc:
                return Sample(arm, pass_name, self.concurrency, example.id, 0.0, 0.0, 0, 0, error=str(exc))
            return sample_of(arm, pass_name, self.concurrency, example, reply)

        meter = CpuMeter(exclude_pids=self.endpoints.server_pids)
        meter.start()
        started = time.perf_counter()
        if self.options.arrival_rate:
            samples = await open_loop(examples, self.options.arrival_rate, one, seed=chunk_index)
        else:
            samples = await closed_loop(examples, self.concurrency, one)
        wall = time.perf_counter() - started
        return ArmRun(arm, samples, wall, meter.stop()["others_cpu_frac"])

    async def run(self, examples: list[EvalExample]) -> None:
        chunk_size = self.options.chunk_size(self.concurrency)
        chunks = [examples[i:i + chunk_size] for i in range(0, len(examples), chunk_size)]
        passes = PASSES if self.options.warm_pass else PASSES[:1]
        limits = httpx.Limits(max_connections=(self.concurrency or chunk_size) + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=limits) as client:
            await self.warm_up(client, examples)
            for pass_name in passes:
                for index, chunk in enumerate(chunks):
                    order = ARM_ORDERS[(index + (pass_name == "warm")) % len(ARM_ORDERS)]
                    for arm in order:
                        if arm in ("ideal", "engine"):
                            await self.fetch_ideal(client, chunk)
                        self.runs.append((pass_name, await self.run_arm(client, arm, pass_name, chunk, index)))
                        if self.options.progress:
                            last = self.runs[-1][1]
                            print(f"  {level_label(self.concurrency, self.options.arrival_rate)} {pass_name} chunk {index + 1}/{len(chunks)} {arm}: "
                                  f"{len(last.samples)} req in {last.wall_s:.1f} s "
                                  f"(others' CPU {100 * last.others_cpu_frac:.0f}%)", flush=True)


# ---------------------------------------------------------------------------- summaries
def latency(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None}
    return {"p50": round(percentile(values, 50), 2), "p95": round(percentile(values, 95), 2)}


def summarize_arm(runs: list[ArmRun]) -> dict[str, Any]:
    samples = [s for run in runs for s in run.samples if not s.error]
    wall = sum(run.wall_s for run in runs)
    output_tokens = sum(s.output_tokens for s in samples)
    return {
        "requests": len(samples),
        "errors": sum(1 for run in runs for s in run.samples if s.error),
        "wall_s": round(wall, 3),
        "req_s": round(len(samples) / wall, 4) if wall > 0 else None,
        "output_tok_s": round(output_tokens / wall, 3) if wall > 0 else None,
        "prompt_tokens_mean": round(statistics.fmean(s.prompt_tokens for s in samples), 1) if samples else None,
        "ttft_ms": latency([s.ttft_ms for s in samples]),
        "tpot_ms": latency([t for s in samples if (t := s.tpot_ms) is not None]),
        "e2e_ms": latency([s.e2e_ms for s in samples]),
        "prefill_ms": latency([s.prefill_ms for s in samples if s.prefill_ms is not None]),
        "compression_ms": latency([s.compression_ms for s in samples if s.compression_ms is not None]),
        "compression_stage_ms": stage_latencies(samples),
        "compression_wait_ms": latency([s.compression_wait_ms for s in samples if s.compression_wait_ms is not None]),
        "queue_ms": latency([s.queue_ms for s in samples if s.queue_ms is not None]),
        "compression_engine_ms": latency([s.compression_engine_ms for s in samples
                                          if s.compression_engine_ms is not None]),
        "cached_prompt_tokens_mean": round(statistics.fmean(s.cached_prompt_tokens for s in samples), 2)
        if samples else None,
        "others_cpu_frac_max": round(max((run.others_cpu_frac for run in runs), default=0.0), 3),
        "others_cpu_frac_mean": round(statistics.fmean(run.others_cpu_frac for run in runs), 3) if runs else None,
    }


def ttft_by_position(samples: list[Sample]) -> dict[str, list[float | None]]:
    """Median TTFT per place in a chunk's send order, per arm. In a closed loop the first
    `concurrency` requests of a chunk arrive together (a burst: the last of them waits for every
    prefill before its own), later ones as earlier ones finish; the arms' P95s come from these places."""
    positions = sorted({s.position for s in samples if s.position is not None and not s.error})
    by_arm: dict[str, list[float | None]] = {}
    for arm in ARMS:
        medians = []
        for position in positions:
            values = [s.ttft_ms for s in samples if s.arm == arm and s.position == position and not s.error]
            medians.append(round(statistics.median(values), 1) if values else None)
        if any(value is not None for value in medians):
            by_arm[arm] = medians
    return by_arm


def stage_latencies(samples: list[Sample]) -> dict[str, dict[str, float | None]]:
    """Where compression time goes, per stage (stages that took >= 1 ms at P95 in the arm)."""
    names = sorted({name for s in samples for name in s.compression_stage_ms})
    stages = {name: latency([s.compression_stage_ms[name] for s in samples if name in s.compression_stage_ms])
              for name in names}
    return {name: value for name, value in stages.items() if (value["p95"] or 0.0) >= 1.0}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


INTERVAL_CONFIDENCE = 0.9  # of the bootstrap intervals in the summary and the report


def compression_payback(samples: list[Sample]) -> dict[str, Any]:
    """Per question: compression ms against the prefill ms it saved (full's prefill - compressed's)."""
    by_question: dict[str, dict[str, Sample]] = {}
    for sample in samples:
        if not sample.error and sample.arm in ("full", "compressed"):
            by_question.setdefault(sample.question_id, {})[sample.arm] = sample
    saved, spent, shares = [], [], []
    for pair in by_question.values():
        full, compressed = pair.get("full"), pair.get("compressed")
        if not full or not compressed or full.prefill_ms is None or compressed.prefill_ms is None:
            continue
        prefill_saved = full.prefill_ms - compressed.prefill_ms
        saved.append(prefill_saved)
        spent.append(compressed.compression_ms or 0.0)
        if prefill_saved > 0:
            shares.append((compressed.compression_ms or 0.0) / prefill_saved)
    return {
        "questions": len(saved),
        "prefill_ms_saved": latency(saved) | {"mean": round(statistics.fmean(saved), 2) if saved else None},
        "compression_ms": latency(spent),
        # The acceptance figure: P95 over questions of compression ms / prefill ms saved (<= 0.1).
        "compression_share_of_saving_p95": round(percentile(shares, 95), 4) if shares else None,
        "compression_p95_over_saved_p50": ratio(percentile(spent, 95), percentile(saved, 50)) if saved else None,
    }


def summarize_level(level: E2ERun) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pass_name in PASSES:
        runs = [run for name, run in level.runs if name == pass_name]
        if not runs:
            continue
        arms = {arm: summarize_arm([run for run in runs if run.arm == arm]) for arm in ARMS}
        req_s = {arm: arms[arm]["req_s"] for arm in ARMS}
        samples = [s for run in runs for s in run.samples]
        ttfts = {arm: [s.ttft_ms for s in samples if s.arm == arm and not s.error] for arm in ("compressed", "ideal")}
        out[pass_name] = {
            "arms": arms,
            "gain": ratio(req_s["compressed"], req_s["full"]),
            "efficiency": ratio(req_s["compressed"], req_s["ideal"]),
            "gateway_vs_engine_req_s": ratio(req_s["ideal"], req_s["engine"]),
            "gateway_vs_engine_tpot_p50": ratio(arms["ideal"]["tpot_ms"]["p50"], arms["engine"]["tpot_ms"]["p50"]),
            "compressed_vs_ideal_ttft_p95": ratio(arms["compressed"]["ttft_ms"]["p95"], arms["ideal"]["ttft_ms"]["p95"]),
            "compressed_vs_ideal_ttft_p95_interval": p95_ratio_interval(ttfts["compressed"], ttfts["ideal"]),
            "token_reduction": ratio(arms["full"]["prompt_tokens_mean"], arms["compressed"]["prompt_tokens_mean"]),
            "payback": compression_payback(samples),
            "ttft_ms_by_position": ttft_by_position(samples),
        }
    return out


ACCEPTANCE = (
    # (name, pass, key path, comparison, bar)
    ("gateway passthrough req/s >= 0.9x engine-alone", "cold", ("gateway_vs_engine_req_s",), ">=", 0.9),
    ("gateway passthrough TPOT P50 <= 1.1x engine-alone", "cold", ("gateway_vs_engine_tpot_p50",), "<=", 1.1),
    ("efficiency (compressed/ideal req/s) >= 0.9, cold", "cold", ("efficiency",), ">=", 0.9),
    ("TTFT P95 compressed <= 1.1x ideal, cold", "cold", ("compressed_vs_ideal_ttft_p95",), "<=", 1.1),
    ("gain (compressed/full req/s) >= 3", "cold", ("gain",), ">=", 3.0),
    ("first-sight compression <= 1/10 of prefill saved (P95)", "cold",
     ("payback", "compression_share_of_saving_p95"), "<=", 0.1),
)


def acceptance(level_summary: dict[str, Any], open_loop: bool = False) -> list[dict[str, Any]]:
    checks = []
    for name, pass_name, path, comparison, bar in ACCEPTANCE:
        value: Any = level_summary.get(pass_name, {})
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if open_loop and path[0] in CLOSED_LOOP_ONLY_CHECKS:
            value = None
        met = None if value is None else (value >= bar if comparison == ">=" else value <= bar)
        check = {"check": name, "value": value, "bar": f"{comparison} {bar}", "met": met}
        interval = level_summary.get(pass_name, {}).get(f"{path[0]}_interval") if len(path) == 1 else None
        if interval is not None and value is not None:  # a summary figure with a bootstrap interval beside it
            check["interval"] = interval
        checks.append(check)
    return checks


# ---------------------------------------------------------------------------- report
def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# End-to-end benchmark: saved prompt tokens as saved time",
        "",
        f"- Command: `{report['command']}`",
        f"- Dataset: `{report['dataset']}` ({report['questions']} questions), {report['output_tokens']} output "
        "tokens per request (ignore_eos), streamed, every prompt starts with a unique tag (no prefix-cache hits)",
        f"- Policies: compressed `{report['policy']}`, full `{report['full_policy']}`; "
        f"gateway embedder on the {report.get('embed_on', 'process')}"
        + (f", {report['compression_workers']} compression worker(s)" if "compression_workers" in report else "")
        + (f" at nice {report['compression_nice']}" if "compression_nice" in report else "")
        + (f", engine step budget {report['max_num_batched_tokens']} tokens"
           if report.get("max_num_batched_tokens") else ""),
        f"- CPU path: {report['cpu_path']}",
        f"- Machine load: other processes took up to {100 * report['others_cpu_frac_max']:.0f}% of the machine's "
        f"CPU during a chunk (mean {100 * report['others_cpu_frac_mean']:.0f}%); figures are noisy, compare ratios.",
        "",
    ]
    arrival_rate = report.get("arrival_rate")
    if arrival_rate:
        lines[-1:-1] = [f"- Open loop: requests arrive at {arrival_rate:g} requests/s (Poisson, the same schedule "
                        "for every arm of a chunk) whether or not earlier ones finished; req/s is what an arm "
                        "served of that, so gain, efficiency and passthrough req/s are left to closed-loop runs."]
    for concurrency, level in report["levels"].items():
        label = level_label(int(concurrency), arrival_rate, long=True)
        for pass_name, summary in level["summary"].items():
            lines += [f"## {label[0].upper() + label[1:]}, {pass_name} pass", ""]
            lines += ["| arm | req/s | out tok/s | prompt tok | TTFT P50 / P95 ms | TPOT P50 / P95 ms | "
                      "e2e P50 / P95 ms | prefill P50 ms | compression P50 / P95 ms | others' CPU max |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
            for arm, row in summary["arms"].items():
                lines.append(
                    f"| {arm} | {_f(row['req_s'])} | {_f(row['output_tok_s'], 1)} | {_f(row['prompt_tokens_mean'], 0)} | "
                    f"{_pair(row['ttft_ms'])} | {_pair(row['tpot_ms'], 1)} | {_pair(row['e2e_ms'])} | "
                    f"{_f(row['prefill_ms']['p50'], 0)} | {_pair(row['compression_ms'], 1)} | "
                    f"{100 * row['others_cpu_frac_max']:.0f}% |"
                )
            payback = summary["payback"]
            lines += [
                "",
                f"- gain (compressed / full req/s): **{_f(summary['gain'], 2)}** "
                f"(prompt tokens {_f(summary['token_reduction'], 2)}x fewer); "
                f"efficiency (compressed / ideal req/s): **{_f(summary['efficiency'], 2)}**",
                f"- gateway with passthrough prompts vs engine alone: req/s x{_f(summary['gateway_vs_engine_req_s'], 2)}, "
                f"TPOT P50 x{_f(summary['gateway_vs_engine_tpot_p50'], 2)}; "
                f"TTFT P95 compressed / ideal: x{_f(summary['compressed_vs_ideal_ttft_p95'], 2)}"
                + _interval(summary.get("compressed_vs_ideal_ttft_p95_interval"),
                            f" ({INTERVAL_CONFIDENCE:.0%} bootstrap interval ", ")"),
                f"- prefill ms saved per request (full - compressed): P50 {_f(payback['prefill_ms_saved']['p50'], 0)}, "
                f"mean {_f(payback['prefill_ms_saved']['mean'], 0)}; compression ms P50 / P95 "
                f"{_pair(payback['compression_ms'], 1)}; compression / saving P95 "
                f"{_f(payback['compression_share_of_saving_p95'], 3)}",
            ]
            compressed = summary["arms"].get("compressed") or {}
            stages = compressed.get("compression_stage_ms") or {}
            if stages:
                lines.append("- compressed arm, compression ms by stage (P50 / P95): " + ", ".join(
                    f"{name} {_pair(value, 1)}" for name, value in stages.items()))
            wait = compressed.get("compression_wait_ms") or {}
            if wait.get("p50") is not None:
                lines.append(f"- compressed arm, ms waiting for a compression worker (P50 / P95, in TTFT, not in "
                             f"compression ms): {_pair(wait, 1)}")
            engine_ms = compressed.get("compression_engine_ms") or {}
            if engine_ms.get("p50") is not None:
                lines.append("- compressed arm, ms its compression's embedding passes held the engine's thread (P50 / "
                             f"P95; every request in the engine waits meanwhile): {_pair(engine_ms, 1)}")
            queues = {arm: (row.get("queue_ms") or {}) for arm, row in summary["arms"].items()}
            if any(queue.get("p50") is not None for queue in queues.values()):
                lines.append("- engine queue ms, from submission to the first step (P50 / P95, in TTFT; most of it "
                             "the wait for the step in progress): " + ", ".join(
                                 f"{arm} {_pair(queue, 1)}" for arm, queue in queues.items() if queue.get("p50") is not None))
            lines += render_positions(summary.get("ttft_ms_by_position") or {})
            lines.append("")
        lines += [f"### Acceptance at {label}", "", "| check | value | bar | met |",
                  "| --- | --- | --- | --- |"]
        for check in level["acceptance"]:
            met = "–" if check["met"] is None else ("yes" if check["met"] else "**no**")
            value = _f(check["value"]) + _interval(check.get("interval"), " [", "]")
            lines.append(f"| {check['check']} | {value} | {check['bar']} | {met} |")
        if any(check.get("interval") for check in level["acceptance"]):
            lines += ["", f"In brackets: a {INTERVAL_CONFIDENCE:.0%} bootstrap interval (each arm's requests "
                          "resampled); a bar inside it is within this run's noise."]
        lines.append("")
    lines += [f"![requests/s and TTFT per arm]({report['plot']})", ""] if report.get("plot") else []
    return "\n".join(lines)


def render_positions(by_arm: dict[str, list[float | None]]) -> list[str]:
    """The TTFT-by-position table (ttft_by_position), with compressed / ideal where both ran."""
    if not by_arm:
        return []
    arms = list(by_arm)
    width = max(len(values) for values in by_arm.values())
    with_ratio = "compressed" in by_arm and "ideal" in by_arm
    lines = ["", "TTFT P50 ms by place in a chunk's send order (closed loop: the first `concurrency` are sent "
             "together, the others as earlier requests of the chunk finish):", "",
             "| place | " + " | ".join(arms) + (" | compressed / ideal |" if with_ratio else ""),
             "| --- |" + " --- |" * (len(arms) + with_ratio)]
    for index in range(width):
        cells = [_f(by_arm[arm][index] if index < len(by_arm[arm]) else None, 0) for arm in arms]
        row = f"| {index + 1} | " + " | ".join(cells) + " |"
        if with_ratio:
            compressed, ideal = by_arm["compressed"], by_arm["ideal"]
            row += f" {_f(ratio(compressed[index], ideal[index]) if index < min(len(compressed), len(ideal)) else None, 2)} |"
        lines.append(row)
    return lines


def level_label(concurrency: int, arrival_rate: float | None, long: bool = False) -> str:
    if arrival_rate:
        return f"open loop at {arrival_rate:g} requests/s" if long else f"rate={arrival_rate:g}/s"
    return f"concurrency {concurrency}" if long else f"c={concurrency}"


def _interval(interval: list[float] | None, before: str, after: str) -> str:
    return f"{before}{interval[0]:.2f}-{interval[1]:.2f}{after}" if interval else ""


def _f(value: Any, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pair(values: dict[str, Any], digits: int = 0) -> str:
    return f"{_f(values['p50'], digits)} / {_f(values['p95'], digits)}"


def plot(report: dict[str, Any], path: Path) -> None:
    """Requests/s and TTFT P50/P95 per arm, one group per concurrency level (cold pass)."""
    from eval.plots import _pyplot

    plt = _pyplot()
    levels = list(report["levels"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(ARMS)
    for index, arm in enumerate(ARMS):
        positions = [i + (index - (len(ARMS) - 1) / 2) * width for i in range(len(levels))]
        rows = [report["levels"][c]["summary"]["cold"]["arms"][arm] for c in levels]
        left.bar(positions, [row["req_s"] or 0 for row in rows], width, label=arm)
        right.bar(positions, [row["ttft_ms"]["p95"] or 0 for row in rows], width, color=f"C{index}", alpha=0.35)
        right.bar(positions, [row["ttft_ms"]["p50"] or 0 for row in rows], width, color=f"C{index}", label=arm)
    for axis, title in ((left, "requests/s (cold pass)"), (right, "TTFT ms: P50 (solid) / P95 (light)")):
        axis.set_xticks(range(len(levels)), [level_label(int(c), report.get("arrival_rate")) for c in levels])
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
    left.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---------------------------------------------------------------------------- entry point
async def model_name(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(url + "/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])


def start_local_engine(model: str | None, max_num_batched_tokens: int | None = None) -> Any:
    """The built-in engine in this process, configured as `ctxgate serve` configures its own."""
    from backend.async_engine import AsyncEngine
    from backend.config import EngineConfig
    from backend.model_prepare import prepare_default_model

    budget = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
    engine = AsyncEngine(EngineConfig(model=str(model or prepare_default_model()), **budget))
    engine.start()
    return engine


def run_bench_e2e(options: E2EOptions, out_dir: str | Path, command: str = "") -> dict[str, Any]:
    from eval.report import cpu_path_line
    from eval.server import EngineServerProcess, GatewayProcess

    dataset = load_dataset(resolve_dataset_path(options.dataset), limit=options.limit)
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    levels: dict[str, Any] = {}
    all_runs: list[ArmRun] = []
    from gateway.settings import DEFAULT_COMPRESSION_NICE, default_compression_workers

    compression_workers = options.compression_workers or default_compression_workers()
    compression_nice = DEFAULT_COMPRESSION_NICE if options.compression_nice is None else options.compression_nice
    step_budget = (["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
                   if options.max_num_batched_tokens else [])
    with contextlib.ExitStack() as stack:
        engine_url, engine_pid, local_engine = None, None, None
        if options.engine_server:
            engine_server = EngineServerProcess(model=options.model, log_path=target / "engine.log",
                                                extra_args=step_budget)
            engine_url, engine_pid = stack.enter_context(engine_server), engine_server.pid
        else:
            local_engine = start_local_engine(options.model, options.max_num_batched_tokens)
            stack.callback(local_engine.shutdown)
        for concurrency in options.levels:
            # A fresh gateway per level, without a shared (Redis) cache: the documents are new to it.
            gateway = GatewayProcess(policy_dir=options.policy_dir, model=options.model,
                                     log_path=target / f"gateway-c{concurrency}.log", env={"REDIS_URL": None, "CTXGATE_EMBED_CACHE_URL": None},
                                     extra_args=["--embed-on", options.embed_on, "--compression-workers",
                                                 str(compression_workers), "--compression-nice",
                                                 str(compression_nice)] + step_budget)
            with gateway as gateway_url:
                endpoints = Endpoints(gateway_url, engine_url, asyncio.run(model_name(gateway_url)),
                                      [pid for pid in (gateway.pid, engine_pid) if pid], local_engine)
                level = E2ERun(endpoints, options, concurrency)
                asyncio.run(level.run(dataset.examples))
            all_runs += [run for _, run in level.runs]
            summary = summarize_level(level)
            levels[str(concurrency)] = {
                "summary": summary,
                "acceptance": acceptance(summary, open_loop=bool(options.arrival_rate)),
                "samples": [asdict(run_sample) for _, run in level.runs for run_sample in run.samples],
            }
    report: dict[str, Any] = {
        "schema": "ctxgate.bench_e2e/v1",
        "command": command,
        "dataset": dataset.path,
        "questions": len(dataset.examples),
        "output_tokens": options.output_tokens,
        "policy": options.policy,
        "full_policy": options.full_policy,
        "embed_on": options.embed_on,
        "compression_workers": compression_workers,
        "compression_nice": compression_nice,
        "max_num_batched_tokens": options.max_num_batched_tokens,
        "arrival_rate": options.arrival_rate,
        "cpu_path": cpu_path_line(),
        "others_cpu_frac_max": round(max((r.others_cpu_frac for r in all_runs), default=0.0), 3),
        "others_cpu_frac_mean": round(statistics.fmean(r.others_cpu_frac for r in all_runs), 3) if all_runs else 0.0,
        "levels": levels,
        "plot": "bench_e2e.png",
    }
    plot(report, target / "bench_e2e.png")
    (target / "bench_e2e.json").write_text(json.dumps(report, indent=2))
    (target / "bench_e2e.md").write_text(render_markdown(report))
    return report

