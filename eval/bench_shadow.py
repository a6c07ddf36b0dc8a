"""`ctxgate bench shadow`: what shadowing costs live requests under open-loop load at the knee.

Two arms of `ctxgate bench slo`'s machinery on one gateway: the policy as shipped (shadowing off) and
the same policy with `shadow: {sample_rate: 0.2}` (its other shadow fields at their defaults, as an
operator would turn it on), interleaved in chunks on the same arrival schedules and questions. After
each chunk of the shadowed arm, the run waits until every request it drew is compared or dropped, so
no shadow work spills into the other arm's chunk: the live requests of the shadowed arm pay for the
shadow work that ran beside them, and the other arm for none. The gateway's shadow counters, read
before and after each rate, must account for every drawn request (ctxgate.eval.shadow_cost_report).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ctxgate.eval.bench_slo import SloOptions, SloRun, gateway_facts, others_cpu
from ctxgate.eval.datasets import EvalExample
from ctxgate.eval.shadow_cost_report import answered, cost_checks, drop_accounting, render_markdown, verdict
from ctxgate.eval.shadow_setup import (
    ShadowCounts,
    policy_source,
    read_counts,
    shadowed_policy,
    write_policy_dir,
)
from ctxgate.eval.slo_report import SloSample

SETTLE_GRACE_S = 30.0
POLL_S = 0.2


@dataclass
class ShadowBenchOptions:
    dataset: str = "nq-multidoc-dev.jsonl"
    split: str = "test"
    requests: int = 48  # per arm and rate
    rates: list[float] = field(default_factory=lambda: [0.6])  # `ctxgate bench slo`'s knee
    policy: str = "rag-default"
    sample_rate: float = 0.2
    adaptive: str = "rag-adaptive"  # only for its TTFT objective, as `bench slo` reads it
    slo_s: float | None = None
    output_tokens: int = 16
    chunk_size: int = 8
    model: str | None = None
    policy_dir: str | None = None
    progress: bool = True
    seed: int = 0
    give_up_s: float | None = None

    @property
    def shadowed(self) -> str:
        return f"{self.policy}-shadow"

    def slo_options(self) -> SloOptions:
        return SloOptions(
            dataset=self.dataset,
            split=self.split,
            requests=self.requests,
            rates=self.rates,
            policies=[self.policy, self.shadowed],
            adaptive=self.adaptive,
            slo_s=self.slo_s,
            output_tokens=self.output_tokens,
            chunk_size=self.chunk_size,
            model=self.model,
            progress=self.progress,
            seed=self.seed,
            give_up_s=self.give_up_s,
            baselines=False,
        )


class ShadowCostRun(SloRun):
    """`SloRun` over the two arms, settling the shadow work after each shadowed chunk."""

    def __init__(
        self, url: str, model: str, options: ShadowBenchOptions, slo_s: float, server_pids: list[int]
    ):
        super().__init__(url, model, options.slo_options(), slo_s, server_pids)
        self.bench = options
        self.shadow_timeout_s = 60.0  # the shadow section's default timeout_s
        self.counts: dict[float, ShadowCounts] = {}  # per rate: what the counters gained

    async def settle(self, client: httpx.AsyncClient) -> ShadowCounts:
        deadline = time.monotonic() + self.shadow_timeout_s + SETTLE_GRACE_S
        while True:
            counts = await read_counts(client, self.url, self.bench.shadowed)
            if counts.settled >= counts.sampled:
                return counts
            if time.monotonic() > deadline:
                raise RuntimeError("shadow requests did not settle in time: see the gateway log")
            await asyncio.sleep(POLL_S)

    async def run_arm(
        self,
        client: httpx.AsyncClient,
        arm: str,
        rate: float,
        chunk: int,
        examples: list[EvalExample],
        offsets: list[float],
    ) -> list[SloSample]:
        results = await super().run_arm(client, arm, rate, chunk, examples, offsets)
        if arm == self.bench.shadowed:
            await self.settle(client)
        return results

    async def run_rate(
        self, client: httpx.AsyncClient, rate_index: int, rate: float, examples: list[EvalExample]
    ) -> None:
        before = await self.settle(client)  # the warm-up's draws, or the last rate's
        await super().run_rate(client, rate_index, rate, examples)
        self.counts[rate] = (await self.settle(client)).since(before)

    async def score_retention(self, client: httpx.AsyncClient, examples: Any) -> None:
        return None  # the cost is what this measures; `ctxgate eval shadow-agreement` the quality


def rate_report(run: ShadowCostRun, rate: float, slo_s: float) -> dict[str, Any]:
    off_arm, on_arm = run.bench.policy, run.bench.shadowed
    samples = [s for s in run.samples if s.rate == rate]
    off = [s for s in samples if s.arm == off_arm]
    on = [s for s in samples if s.arm == on_arm]
    level = cost_checks(off, on, rate, slo_s, run.give_up_s)
    level["drops"] = drop_accounting(
        run.counts.get(rate, ShadowCounts()), answered(on), run.bench.sample_rate
    )
    level["others_cpu"] = others_cpu(run.chunk_runs, rate, [off_arm, on_arm])
    return level


def run_bench_shadow(options: ShadowBenchOptions, out_dir: str | Path, command: str = "") -> dict[str, Any]:
    from ctxgate.eval.bench_e2e import model_name
    from ctxgate.eval.bench_slo import questions
    from ctxgate.eval.server import GatewayProcess

    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    dataset_path, examples = questions(options.slo_options())
    source = policy_source(options.policy, options.policy_dir)
    derived = shadowed_policy(source, options.shadowed, {"sample_rate": options.sample_rate})
    policies = write_policy_dir(target / "policies", options.policy_dir, [derived])
    started = time.perf_counter()
    # No shared (Redis) cache, as in `bench slo`: the passages are new to the gateway.
    gateway = GatewayProcess(
        policy_dir=policies,
        model=options.model,
        log_path=target / "gateway.log",
        env={"REDIS_URL": None, "CTXGATE_EMBED_CACHE_URL": None},
    )
    with gateway as url:
        slo_from_policy, engine_path = asyncio.run(gateway_facts(url, options.adaptive))
        slo_s = options.slo_s or slo_from_policy
        if slo_s is None:
            raise ValueError(
                f"policy '{options.adaptive}' has no adaptive section on this gateway: pass --slo-s"
            )
        pids = [gateway.pid] if gateway.pid else []
        run = ShadowCostRun(url, asyncio.run(model_name(url)), options, slo_s, pids)
        asyncio.run(run.run(examples))
    rates = {f"{rate:g}": rate_report(run, rate, slo_s) for rate in options.rates}
    shares = [item["others_cpu_frac"] for item in run.chunk_runs]
    report: dict[str, Any] = {
        "schema": "ctxgate.bench_shadow/v1",
        "command": command,
        "dataset": dataset_path,
        "split": options.split,
        "questions": [example.id for example in examples],
        "requests_per_arm": len(examples),
        "rates_per_s": options.rates,
        "policy": options.policy,
        "arms": [options.policy, options.shadowed],
        "sample_rate": options.sample_rate,
        "shadow": derived["shadow"],
        "slo_s": slo_s,
        "give_up_s": run.give_up_s,
        "chunk_size": options.chunk_size,
        "output_tokens": options.output_tokens,
        "engine_path": engine_path,
        "others_cpu_frac_mean": round(statistics.fmean(shares), 3) if shares else None,
        "chunk_runs": run.chunk_runs,
        "wall_s": round(time.perf_counter() - started, 1),
        "rates": rates,
        "acceptance_met": verdict(rates),
        "samples": [asdict(sample) for sample in run.samples],
    }
    (target / "bench_shadow.json").write_text(json.dumps(report, indent=2))
    (target / "bench_shadow.md").write_text(render_markdown(report))
    return report
