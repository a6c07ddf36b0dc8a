"""`ctxgate bench slo`: goodput under a TTFT objective, fixed budgets against budgets that follow the load.

Requests arrive open loop (Poisson) at several rates, below, at and above the knee; at each rate the
same held-out questions (the test half of eval/splits.py) go through a real `ctxgate serve` over
HTTP under each arm: passthrough, each fixed policy and the adaptive one. Arms are interleaved in
chunks, every arm of a chunk offered the same arrival schedule and questions, and the order of the
compressing arms rotated per chunk (the first of them sees the chunk's passages first and pays the
embedding; rotation spreads that evenly over chunk counts that are a multiple of their number).

TTFT is the client's, from sending the request to the first streamed token, so compression is in
it. Answer retention is measured on the prompt each request's model saw: the fixed policies'
prompts are fetched from /v1/ctxgate/compress (deterministic per question, so requests that were
abandoned count too), the adaptive arm's at the budget the controller chose for that request
(usage.ctxgate.budget; an abandoned adaptive request reported none and is not scored), after the
timed requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ctxgate.eval import loadgen, streaming
from ctxgate.eval.bench_e2e import model_name, new_tag
from ctxgate.eval.bench_engine import CpuMeter
from ctxgate.eval.client import ctxgate_extra, question_messages, retry_after_s
from ctxgate.eval.datasets import EvalExample, load_dataset, resolve_dataset_path
from ctxgate.eval.evidence import evidence_retention
from ctxgate.eval.slo_report import SloSample, acceptance, knee_side, plot, render_markdown, summarize_rate
from ctxgate.eval.splits import split_examples

PASSTHROUGH = "passthrough"
# A request without a first token after this many objectives is abandoned: it missed long ago, and
# an overloaded arm's queue would otherwise take minutes to drain on two cores.
GIVE_UP_SLOS = 4.0
# How many times one retention replay waits out a 429 (each wait at most 60 s) before it fails.
QUOTA_WAITS = 20


@dataclass
class SloOptions:
    dataset: str = "nq-multidoc-dev.jsonl"
    split: str = "test"
    requests: int = 24  # per arm and rate
    rates: list[float] = field(default_factory=lambda: [0.3, 0.6, 1.0])
    policies: list[str] = field(default_factory=lambda: ["rag-default", "rag-fast"])  # the fixed arms
    adaptive: str = "rag-adaptive"
    slo_s: float | None = None  # None: the adaptive policy's ttft_slo_s
    knee: float = 0.6  # requests/s: rates below it are "below the knee", above it "above"
    output_tokens: int = 16
    chunk_size: int = 8
    model: str | None = None
    policy_dir: str | None = None
    max_num_batched_tokens: int | None = None
    progress: bool = True
    seed: int = 0
    give_up_s: float | None = None  # None: 4 x the objective
    baselines: bool = True  # False: the fixed arms only (`ctxgate bench shadow`'s two)

    @property
    def arms(self) -> list[str]:
        if not self.baselines:
            return list(dict.fromkeys(self.policies))
        arms = [PASSTHROUGH, *self.policies, self.adaptive]
        return list(dict.fromkeys(arms))  # in order, once each

    @property
    def fixed(self) -> list[str]:
        return [arm for arm in self.policies if arm not in (PASSTHROUGH, self.adaptive)]


def arm_order(arms: Sequence[str], chunk: int) -> list[str]:
    """The chunk's order: the compressing arms rotated by the chunk's index, passthrough (nothing to
    embed, nothing to warm) at a rotating place among them."""
    compressing = [arm for arm in arms if arm != PASSTHROUGH]
    shift = chunk % len(compressing) if compressing else 0
    order = compressing[shift:] + compressing[:shift]
    if PASSTHROUGH in arms:
        order.insert(chunk % (len(order) + 1), PASSTHROUGH)
    return order


def chunks_of(examples: Sequence[EvalExample], size: int) -> list[list[EvalExample]]:
    return [list(examples[i : i + size]) for i in range(0, len(examples), size)]


def schedule_seed(seed: int, rate_index: int, chunk: int) -> int:
    """One arrival schedule per (rate, chunk), shared by the chunk's arms."""
    return seed * 1_000_003 + rate_index * 1000 + chunk


def request_body(example: EvalExample, policy: str, model: str, output_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": question_messages(example, cache_buster=new_tag()),
        "max_tokens": output_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        **ctxgate_extra(example, policy),
    }


def sample_of(
    arm: str, rate: float, chunk: int, position: int, example: EvalExample, timing: streaming.StreamTiming
) -> SloSample:
    extra = timing.usage.get("ctxgate") or {}
    budget = extra.get("budget") or {}
    return SloSample(
        arm=arm,
        rate=rate,
        chunk=chunk,
        position=position,
        question_id=example.id,
        ttft_ms=round(timing.ttft_s * 1000, 2),
        e2e_ms=round(timing.e2e_s * 1000, 2),
        prompt_tokens=timing.usage.get("prompt_tokens"),
        original_prompt_tokens=extra.get("original_prompt_tokens"),
        budget_tokens=budget.get("documents_tokens"),
        budget_reason=budget.get("reason"),
        gateway_ttft_s=budget.get("measured_ttft_s"),
    )


class SloRun:
    """The arms over the chunks at each rate, against one running gateway."""

    def __init__(
        self, url: str, model: str, options: SloOptions, slo_s: float, server_pids: Sequence[int] = ()
    ):
        self.url = url
        self.model = model
        self.options = options
        self.slo_s = slo_s
        self.give_up_s = options.give_up_s or GIVE_UP_SLOS * slo_s
        self.server_pids = list(server_pids)
        self.samples: list[SloSample] = []
        # (rate, chunk, arm, wall s, the share of the machine's CPU other processes took meanwhile)
        self.chunk_runs: list[dict[str, Any]] = []
        self._sent: dict[tuple[str, str, int | None], list[dict[str, Any]]] = {}  # prompts, for retention

    async def one(
        self,
        client: httpx.AsyncClient,
        arm: str,
        rate: float,
        chunk: int,
        position: int,
        example: EvalExample,
    ) -> SloSample:
        body = request_body(example, arm, self.model, self.options.output_tokens)
        try:
            timing = await streaming.stream_chat(client, self.url, body, first_token_timeout_s=self.give_up_s)
        except TimeoutError:
            return SloSample(
                arm,
                rate,
                chunk,
                position,
                example.id,
                None,
                abandoned=True,
                error=f"no first token within {self.give_up_s:g} s (abandoned)",
            )
        except (httpx.HTTPError, RuntimeError) as exc:
            return SloSample(arm, rate, chunk, position, example.id, None, error=str(exc)[:300])
        return sample_of(arm, rate, chunk, position, example, timing)

    async def run_arm(
        self,
        client: httpx.AsyncClient,
        arm: str,
        rate: float,
        chunk: int,
        examples: list[EvalExample],
        offsets: list[float],
    ) -> list[SloSample]:
        places = list(enumerate(examples))
        return await loadgen.open_loop(
            places, offsets, lambda place: self.one(client, arm, rate, chunk, place[0], place[1])
        )

    async def warm_up(self, client: httpx.AsyncClient, examples: list[EvalExample]) -> None:
        """Load what loads lazily (the embedder, first-call allocations) and give the adaptive
        controller a prefill speed, on scrambled copies nobody measures."""
        from ctxgate.eval.bench_prefill import scrambled_copy

        for example in examples[:2]:
            for arm in self.options.arms:
                body = request_body(scrambled_copy(example), arm, self.model, 2)
                await streaming.stream_chat(client, self.url, body)

    async def run_rate(
        self, client: httpx.AsyncClient, rate_index: int, rate: float, examples: list[EvalExample]
    ) -> None:
        for chunk, members in enumerate(chunks_of(examples, self.options.chunk_size)):
            offsets = loadgen.poisson_offsets(
                len(members), rate, schedule_seed(self.options.seed, rate_index, chunk)
            )
            for arm in arm_order(self.options.arms, chunk):
                meter = CpuMeter(exclude_pids=self.server_pids)
                meter.start()
                started = time.perf_counter()
                results = await self.run_arm(client, arm, rate, chunk, members, offsets)
                self.samples += results
                self.chunk_runs.append(
                    {
                        "rate": rate,
                        "chunk": chunk,
                        "arm": arm,
                        "wall_s": round(time.perf_counter() - started, 2),
                        "others_cpu_frac": round(meter.stop()["others_cpu_frac"], 3),
                    }
                )
                if self.options.progress:
                    met = sum(s.met(self.slo_s) for s in results)
                    print(
                        f"  {rate:g} req/s chunk {chunk + 1} {arm}: {met}/{len(results)} within "
                        f"{self.slo_s:g} s in {time.perf_counter() - started:.1f} s",
                        flush=True,
                    )

    # -- retention, after the timed requests ------------------------------------------------------
    async def sent_messages(
        self, client: httpx.AsyncClient, example: EvalExample, arm: str, budget: int | None
    ) -> list[dict[str, Any]]:
        """The messages the gateway sends for this question under the arm's policy (at `budget`
        documents tokens: the adaptive arm's chosen budget); cached per (question, arm, budget)."""
        key = (example.id, arm, budget)
        if key not in self._sent:
            overrides = {"documents.max_tokens": budget} if budget is not None else None
            body = {
                "model": self.model,
                "messages": question_messages(example),
                **ctxgate_extra(example, arm, overrides),
            }
            # Scoring replays every question under every arm at once, far faster than any tenant's
            # quota allows: a 429 is waited out, since the quota is not what this scores.
            for _ in range(QUOTA_WAITS):
                response = await client.post(self.url + "/v1/ctxgate/compress", json=body)
                if response.status_code != 429:
                    break
                await asyncio.sleep(min(retry_after_s(response.headers), 60.0))
            response.raise_for_status()
            self._sent[key] = response.json()["messages"]
        return self._sent[key]

    async def score_retention(self, client: httpx.AsyncClient, examples: Sequence[EvalExample]) -> None:
        by_id = {example.id: example for example in examples}
        for sample in self.samples:
            adaptive = sample.arm == self.options.adaptive
            # A fixed policy's prompt depends on the question alone, so a request that failed or was
            # abandoned is scored too; the adaptive arm's depends on a budget only a reply reports.
            if sample.answer_retained is not None or (adaptive and sample.budget_tokens is None):
                continue
            budget = sample.budget_tokens if adaptive else None
            example = by_id[sample.question_id]
            messages = await self.sent_messages(client, example, sample.arm, budget)
            sample.answer_retained = evidence_retention(example, messages).answer_retained

    async def run(self, examples: list[EvalExample]) -> None:
        limits = httpx.Limits(max_connections=self.options.chunk_size + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=limits) as client:
            await self.warm_up(client, examples)
            for rate_index, rate in enumerate(self.options.rates):
                await self.run_rate(client, rate_index, rate, examples)
            await self.score_retention(client, examples)


async def gateway_facts(url: str, adaptive: str) -> tuple[float | None, Any]:
    """The adaptive policy's TTFT objective as the gateway applies it, and the engine's kernel path."""
    async with httpx.AsyncClient(timeout=30) as client:
        listed = (await client.get(url + "/v1/ctxgate/policies")).json()["policies"]
        models = (await client.get(url + "/v1/models")).json()["data"]
    policy = next((item["effective"] for item in listed if item["name"] == adaptive), None)
    slo = policy["adaptive"]["ttft_slo_s"] if policy and policy["adaptive"]["enabled"] else None
    return slo, models[0].get("engine_path")


def others_cpu(
    chunk_runs: Sequence[dict[str, Any]], rate: float, arms: Sequence[str]
) -> dict[str, float | None]:
    """Per arm at this rate: the mean share of the machine other processes took while it ran."""
    out: dict[str, float | None] = {}
    for arm in arms:
        shares = [
            item["others_cpu_frac"] for item in chunk_runs if item["rate"] == rate and item["arm"] == arm
        ]
        out[arm] = round(statistics.fmean(shares), 3) if shares else None
    return out


def questions(options: SloOptions) -> tuple[str, list[EvalExample]]:
    dataset = load_dataset(resolve_dataset_path(options.dataset))
    held_out = split_examples(dataset.examples, options.split)
    return dataset.path, held_out[: options.requests]


def run_bench_slo(options: SloOptions, out_dir: str | Path, command: str = "") -> dict[str, Any]:
    from ctxgate.eval.report import cpu_path_line
    from ctxgate.eval.server import GatewayProcess

    dataset_path, examples = questions(options)
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    step_budget = (
        ["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
        if options.max_num_batched_tokens
        else []
    )
    started = time.perf_counter()
    # No shared (Redis) cache: the passages are new to the gateway, as a live stream's mostly are.
    gateway = GatewayProcess(
        policy_dir=options.policy_dir,
        model=options.model,
        log_path=target / "gateway.log",
        env={"REDIS_URL": None, "CTXGATE_EMBED_CACHE_URL": None},
        extra_args=step_budget,
    )
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(gateway)
        slo_from_policy, engine_path = asyncio.run(gateway_facts(url, options.adaptive))
        slo_s = options.slo_s or slo_from_policy
        if slo_s is None:
            raise ValueError(
                f"policy '{options.adaptive}' has no adaptive section on this gateway: pass --slo-s"
            )
        run = SloRun(url, asyncio.run(model_name(url)), options, slo_s, [gateway.pid] if gateway.pid else [])
        asyncio.run(run.run(examples))
    rates: dict[str, Any] = {}
    for rate in options.rates:
        samples = [s for s in run.samples if s.rate == rate]
        summary = summarize_rate(samples, rate, slo_s, options.arms, run.give_up_s)
        rates[f"{rate:g}"] = {
            "side": knee_side(rate, options.knee),
            "arms": summary,
            "others_cpu": others_cpu(run.chunk_runs, rate, options.arms),
            "acceptance": acceptance(
                samples, rate, slo_s, summary, options.adaptive, options.fixed, options.knee
            ),
        }
    shares = [item["others_cpu_frac"] for item in run.chunk_runs]
    verdicts = [check["met"] for level in rates.values() for check in level["acceptance"]]
    report: dict[str, Any] = {
        "schema": "ctxgate.bench_slo/v1",
        "command": command,
        "dataset": dataset_path,
        "split": options.split,
        "questions": [example.id for example in examples],
        "requests_per_arm": len(examples),
        "rates_per_s": options.rates,
        "arms": options.arms,
        "fixed_policies": options.fixed,
        "adaptive_policy": options.adaptive,
        "slo_s": slo_s,
        "knee": options.knee,
        "chunk_size": options.chunk_size,
        "give_up_s": run.give_up_s,
        "others_cpu_frac_mean": round(statistics.fmean(shares), 3) if shares else None,
        "others_cpu_frac_max": round(max(shares), 3) if shares else None,
        "chunk_runs": run.chunk_runs,
        "output_tokens": options.output_tokens,
        "cpu_path": cpu_path_line(),
        "engine_path": engine_path,
        "wall_s": round(time.perf_counter() - started, 1),
        "rates": rates,
        "acceptance_met": None if not verdicts or None in verdicts else all(verdicts),
        "plot": "bench_slo.png",
        "samples": [asdict(sample) for sample in run.samples],
    }
    plot(report, target / "bench_slo.png")
    (target / "bench_slo.json").write_text(json.dumps(report, indent=2))
    (target / "bench_slo.md").write_text(render_markdown(report))
    return report
