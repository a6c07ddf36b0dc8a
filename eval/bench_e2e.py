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
Every chunk records the CPU time other processes took meanwhile (ctxgate.eval.bench_engine.CpuMeter).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from ctxgate.client import ctxgate_extra_body
from ctxgate.eval import loadgen, streaming
from ctxgate.eval.bench_engine import CpuMeter
from ctxgate.eval.client import ctxgate_extra, question_messages
from ctxgate.eval.datasets import EvalExample, load_dataset, resolve_dataset_path
from ctxgate.eval.e2e_report import acceptance, level_label, plot, render_markdown, summarize_level
from ctxgate.eval.e2e_samples import ARM_ORDERS, PASSES, TAG_PLACEHOLDER, ArmRun, E2EOptions, Sample
from ctxgate.eval.loadgen import closed_loop
from ctxgate.eval.loadgen import poisson_offsets as arrival_offsets


# ---------------------------------------------------------------------------- requests
def new_tag() -> str:
    """Same length as TAG_PLACEHOLDER: swapping one for the other keeps the prompt's length."""
    return f"bench-tag-{uuid.uuid4().hex[:12]}"


def tagged(messages: list[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    return [{**m, "content": str(m.get("content", "")).replace(TAG_PLACEHOLDER, tag)} for m in messages]


def request_body(
    arm: str,
    example: EvalExample,
    ideal_messages: list[dict[str, Any]] | None,
    options: E2EOptions,
    model: str,
) -> dict[str, Any]:
    """The chat request an arm sends for one question (a fresh tag first in the system prompt)."""
    tag = new_tag()
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": options.output_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
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
    from ctxgate.backend.engine.api import GenerationRequest, SamplingParams
    from ctxgate.backend.engine.deltas import DeltaTotals

    started = time.perf_counter()
    ids = engine.tokenizer.encode_chat(messages)
    request = GenerationRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=ids,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    first: float | None = None
    totals = DeltaTotals(prompt_tokens=len(ids))
    async for delta in engine.generate(request):
        if delta.token_ids and first is None:
            first = time.perf_counter()
        totals.add(delta)
    ended = time.perf_counter()
    metrics = totals.metrics
    usage = {
        "prompt_tokens": len(ids),
        "completion_tokens": totals.completion_tokens,
        "ctxgate": {
            "prefill_ms": metrics.prefill_ms if metrics else None,
            "queue_ms": metrics.queue_ms if metrics else None,
        },
    }
    return {
        "ttft_ms": ((first or ended) - started) * 1000,
        "e2e_ms": (ended - started) * 1000,
        "usage": usage,
    }


def sample_of(
    arm: str, pass_name: str, concurrency: int, example: EvalExample, reply: dict[str, Any]
) -> Sample:
    usage = reply["usage"]
    extra = usage.get("ctxgate") or {}
    compression = extra.get("compression_ms")
    return Sample(
        arm=arm,
        pass_name=pass_name,
        concurrency=concurrency,
        question_id=example.id,
        ttft_ms=reply["ttft_ms"],
        e2e_ms=reply["e2e_ms"],
        output_tokens=int(usage.get("completion_tokens") or 0),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        original_prompt_tokens=extra.get("original_prompt_tokens"),
        cached_prompt_tokens=int(
            extra.get("cached_prompt_tokens")
            or (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            or 0
        ),
        prefill_ms=extra.get("prefill_ms"),
        compression_ms=sum(float(v) for v in compression.values()) if isinstance(compression, dict) else None,
        compression_stage_ms={k: float(v) for k, v in compression.items()}
        if isinstance(compression, dict)
        else {},
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
        from ctxgate.eval.bench_prefill import scrambled_copy

        for example in examples[:2]:
            copy = scrambled_copy(example)
            for arm in ("full", "compressed"):
                body = request_body(arm, copy, None, self.options, self.endpoints.model) | {"max_tokens": 2}
                await stream_chat(client, self.endpoints.gateway, body)
            await self.fetch_ideal(client, [copy])
            await self.engine_request(client, copy, max_tokens=2)

    async def engine_request(
        self, client: httpx.AsyncClient, example: EvalExample, max_tokens: int | None = None
    ) -> dict[str, Any]:
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
            body = {
                "model": self.endpoints.model,
                "messages": question_messages(example, TAG_PLACEHOLDER),
                **ctxgate_extra(example, self.options.policy),
            }
            response = await client.post(self.endpoints.gateway + "/v1/ctxgate/compress", json=body)
            response.raise_for_status()
            payload = response.json()
            self.ideal[example.id] = payload["messages"]
            self.compress_reports[example.id] = payload["report"]

    async def run_arm(
        self,
        client: httpx.AsyncClient,
        arm: str,
        pass_name: str,
        examples: list[EvalExample],
        chunk_index: int = 0,
    ) -> ArmRun:
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
                    body = request_body(
                        arm, example, self.ideal.get(example.id), self.options, self.endpoints.model
                    )
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
        chunks = [examples[i : i + chunk_size] for i in range(0, len(examples), chunk_size)]
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
                        self.runs.append(
                            (pass_name, await self.run_arm(client, arm, pass_name, chunk, index))
                        )
                        if self.options.progress:
                            last = self.runs[-1][1]
                            print(
                                f"  {level_label(self.concurrency, self.options.arrival_rate)} {pass_name} chunk {index + 1}/{len(chunks)} {arm}: "
                                f"{len(last.samples)} req in {last.wall_s:.1f} s "
                                f"(others' CPU {100 * last.others_cpu_frac:.0f}%)",
                                flush=True,
                            )


# ---------------------------------------------------------------------------- summaries
async def model_name(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(url + "/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])


def start_local_engine(model: str | None, max_num_batched_tokens: int | None = None) -> Any:
    """The built-in engine in this process, configured as `ctxgate serve` configures its own."""
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.model.model_prepare import prepare_default_model

    budget = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
    engine = AsyncEngine(EngineConfig(model=str(model or prepare_default_model()), **budget))
    engine.start()
    return engine


def run_bench_e2e(options: E2EOptions, out_dir: str | Path, command: str = "") -> dict[str, Any]:
    from ctxgate.eval.report import cpu_path_line
    from ctxgate.eval.server import EngineServerProcess, GatewayProcess
    from ctxgate.eval.status import Status

    dataset = load_dataset(resolve_dataset_path(options.dataset), limit=options.limit)
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    levels: dict[str, Any] = {}
    all_runs: list[ArmRun] = []
    from ctxgate.gateway.settings import DEFAULT_COMPRESSION_NICE, default_compression_workers

    compression_workers = options.compression_workers or default_compression_workers()
    compression_nice = (
        DEFAULT_COMPRESSION_NICE if options.compression_nice is None else options.compression_nice
    )
    step_budget = (
        ["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
        if options.max_num_batched_tokens
        else []
    )
    with contextlib.ExitStack() as stack:
        engine_url, engine_pid, local_engine = None, None, None
        if options.engine_server:
            engine_server = EngineServerProcess(
                model=options.model, log_path=target / "engine.log", extra_args=step_budget
            )
            engine_url, engine_pid = stack.enter_context(engine_server), engine_server.pid
        else:
            Status()("loading the engine in this process (the model, then its warm-up)")
            local_engine = start_local_engine(options.model, options.max_num_batched_tokens)
            stack.callback(local_engine.shutdown)
        for concurrency in options.levels:
            # A fresh gateway per level, without a shared (Redis) cache: the documents are new to it.
            gateway = GatewayProcess(
                policy_dir=options.policy_dir,
                model=options.model,
                log_path=target / f"gateway-c{concurrency}.log",
                env={"REDIS_URL": None, "CTXGATE_EMBED_CACHE_URL": None},
                extra_args=[
                    "--embed-on",
                    options.embed_on,
                    "--compression-workers",
                    str(compression_workers),
                    "--compression-nice",
                    str(compression_nice),
                ]
                + step_budget,
            )
            with gateway as gateway_url:
                endpoints = Endpoints(
                    gateway_url,
                    engine_url,
                    asyncio.run(model_name(gateway_url)),
                    [pid for pid in (gateway.pid, engine_pid) if pid],
                    local_engine,
                )
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
        "others_cpu_frac_mean": round(statistics.fmean(r.others_cpu_frac for r in all_runs), 3)
        if all_runs
        else 0.0,
        "levels": levels,
        "plot": "bench_e2e.png",
    }
    plot(report, target / "bench_e2e.png")
    (target / "bench_e2e.json").write_text(json.dumps(report, indent=2))
    (target / "bench_e2e.md").write_text(render_markdown(report))
    return report
