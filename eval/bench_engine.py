"""`ctxgate bench engine`: the standard workloads W1-W3 against the built-in engine (or any
OpenAI-compatible server with `--url`) and, in the same run, the plain Hugging Face `generate`
baseline (static batches, same weights, same dtype).

Runs are interleaved (engine, baseline, engine, baseline, ...) because on a small shared machine
the speed drifts over minutes; every run records how much CPU other processes used meanwhile, and
a run that had a busy neighbour is repeated (an engine using both cores collapses when another
process takes one, so such a run measures the neighbour, not the engine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxgate.eval.loadgen import closed_loop
from ctxgate.eval.stats import percentile
from ctxgate.eval.streaming import stream_chat

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    concurrency: int
    description: str = ""


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", 32, 256, 64, 1, "latency"),
    "W2": Workload("W2", 64, 512, 128, 16, "throughput"),
    "W3": Workload("W3", 32, 1500, 32, 8, "prefill-heavy (RAG)"),
}


def scaled_workload(
    workload: Workload,
    num_requests: int | None = None,
    prompt_tokens: int | None = None,
    output_tokens: int | None = None,
    concurrency: int | None = None,
) -> Workload:
    """A scaled-down (or up) copy of a standard workload."""
    return dataclasses.replace(
        workload,
        num_requests=num_requests or workload.num_requests,
        prompt_tokens=prompt_tokens or workload.prompt_tokens,
        output_tokens=output_tokens or workload.output_tokens,
        concurrency=min(concurrency or workload.concurrency, num_requests or workload.num_requests),
    )


# ---------------------------------------------------------------------------- prompts
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which are were be "
    "river mountain city market history science energy water forest bridge engine signal music "
    "garden winter summer station library council harbor village island desert valley theory "
    "method result report growth policy budget network system memory window reason answer "
    "question evidence passage document context summary author century museum painting novel "
    "language student teacher doctor patient company product customer price value number figure "
    "ancient modern famous quiet bright heavy early later several many often rarely always "
    "walked built wrote found opened studied measured carried changed crossed followed joined "
    "north south east west red green blue golden silver stone glass paper iron wooden"
).split()


def make_prompt_messages(tokenizer, workload: Workload, seed: int) -> list[list[dict[str, str]]]:
    """One chat conversation per request, each about `workload.prompt_tokens` long with the chat
    template applied, all different from the first token on (no shared prefix beyond the template)."""
    rng = random.Random(seed)
    overhead = tokenizer.count_chat([{"role": "user", "content": ""}])
    target_body = max(8, workload.prompt_tokens - overhead)
    conversations = []
    for index in range(workload.num_requests):
        nonce = f"Request {uuid.UUID(int=rng.getrandbits(128)).hex[:12]} #{index}."
        # ~1.3 tokens per word; draw generously, then cut to the exact token count.
        words = [rng.choice(_WORDS) for _ in range(int(target_body * 1.2) + 16)]
        body_ids = tokenizer.encode(nonce + " " + " ".join(words))[:target_body]
        conversations.append([{"role": "user", "content": tokenizer.decode(body_ids)}])
    return conversations


# ---------------------------------------------------------------------------- measurements
@dataclass
class RequestResult:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    prompt_tokens: int

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _latency_summary(values_s: Sequence[float]) -> dict[str, float]:
    values_ms = [v * 1000 for v in values_s]
    if not values_ms:
        return {"p50": float("nan"), "p95": float("nan"), "p99": float("nan"), "mean": float("nan")}
    return {
        "p50": percentile(values_ms, 50),
        "p95": percentile(values_ms, 95),
        "p99": percentile(values_ms, 99),
        "mean": statistics.fmean(values_ms),
    }


class CpuMeter:
    """CPU time used by other processes while a run lasts: machine busy time (/proc/stat) minus
    this process's (and `exclude_pids`', e.g. a server under test) own user+system time."""

    def __init__(self, exclude_pids: Sequence[int] = ()):
        self._pids = [os.getpid(), *exclude_pids]
        self._ticks_per_second = os.sysconf("SC_CLK_TCK")
        self._num_cpus = os.cpu_count() or 1

    @staticmethod
    def _machine_busy_ticks() -> int:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal (guest is already inside user).
        return (
            fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + (fields[7] if len(fields) > 7 else 0)
        )

    def _own_pids(self) -> set[int]:
        """The excluded processes and all their descendants (a server's engine and worker
        processes run as children: vLLM's EngineCore, uvicorn workers)."""
        parents: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
        own, frontier = set(self._pids), list(self._pids)
        while frontier:
            for child in parents.get(frontier.pop(), []):
                if child not in own:
                    own.add(child)
                    frontier.append(child)
        return own

    def _own_ticks(self) -> int:
        total = 0
        for pid in self._own_pids():
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # utime, stime, cutime, cstime (children, e.g. a server's workers, count as own).
            total += sum(int(v) for v in fields[11:15])
        return total

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._busy0 = self._machine_busy_ticks()
        self._own0 = self._own_ticks()

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self._t0
        busy = self._machine_busy_ticks() - self._busy0
        own = self._own_ticks() - self._own0
        others_s = max(0, busy - own) / self._ticks_per_second
        return {
            "wall_s": wall,
            "own_cpu_s": own / self._ticks_per_second,
            "others_cpu_s": others_s,
            # Share of the whole machine's capacity that other processes took.
            "others_cpu_frac": others_s / max(wall * self._num_cpus, 1e-9),
        }


def summarize_run(results: list[RequestResult], duration_s: float, cpu: dict[str, float]) -> dict[str, Any]:
    output_tokens = sum(r.output_tokens for r in results)
    return {
        "num_requests": len(results),
        "duration_s": duration_s,
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in results) if results else 0,
        "output_tokens_total": output_tokens,
        "output_tok_s": output_tokens / duration_s if duration_s > 0 else 0.0,
        "req_s": len(results) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": _latency_summary([r.ttft_s for r in results]),
        "tpot_ms": _latency_summary([r.tpot_s for r in results if r.tpot_s is not None]),
        "e2e_ms": _latency_summary([r.e2e_s for r in results]),
        "cpu": cpu,
    }


# ---------------------------------------------------------------------------- runners
class EngineRunner:
    """The in-process `AsyncEngine`, streamed, greedy, ignore_eos."""

    name = "engine"

    def __init__(self, async_engine):
        self.engine = async_engine
        self.engine.start()

    def run(self, conversations: list[list[dict[str, str]]], workload: Workload) -> list[RequestResult]:
        prompts = [self.engine.tokenizer.encode_chat(messages) for messages in conversations]
        return asyncio.run(self._run(prompts, workload))

    async def _run(self, prompts: list[list[int]], workload: Workload) -> list[RequestResult]:
        from ctxgate.backend.engine.api import GenerationRequest, SamplingParams

        async def one(prompt_ids: list[int]) -> RequestResult:
            request = GenerationRequest(
                request_id=uuid.uuid4().hex,
                prompt_token_ids=prompt_ids,
                sampling=SamplingParams(max_tokens=workload.output_tokens, temperature=0, ignore_eos=True),
            )
            start = time.perf_counter()
            first = None
            num_tokens = 0
            async for delta in self.engine.generate(request):
                if delta.token_ids and first is None:
                    first = time.perf_counter()
                num_tokens += len(delta.token_ids)
            end = time.perf_counter()
            return RequestResult(
                ttft_s=(first or end) - start,
                e2e_s=end - start,
                output_tokens=num_tokens,
                prompt_tokens=len(prompt_ids),
            )

        return await _closed_loop(prompts, workload.concurrency, one, f"{self.name} {workload.name}")


class OpenAIServerRunner:
    """Any OpenAI-compatible server through its streaming chat API (vLLM, llama.cpp, ctxgate)."""

    name = "server"

    def __init__(
        self,
        base_url: str,
        model_name: str | None = None,
        tokenizer=None,
        name: str | None = None,
        api_key: str | None = None,
    ):
        import httpx

        if name is not None:
            self.name = name
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        if model_name is None:
            try:
                models = httpx.get(self.base_url + "/v1/models", headers=self.headers, timeout=30).json()
                model_name = models["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                raise ValueError(
                    f"{self.base_url}: no OpenAI-compatible server listed a model at /v1/models ({exc})"
                ) from exc
        self.model_name = model_name
        self.tokenizer = tokenizer

    def run(self, conversations: list[list[dict[str, str]]], workload: Workload) -> list[RequestResult]:
        return asyncio.run(self._run(conversations, workload))

    async def _run(self, conversations, workload: Workload) -> list[RequestResult]:
        import httpx

        limits = httpx.Limits(max_connections=workload.concurrency + 2)
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(600), limits=limits, headers=self.headers
        ) as client:

            async def one(messages) -> RequestResult:
                body = {
                    "model": self.model_name,
                    "messages": messages,
                    "max_tokens": workload.output_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    # vLLM / llama.cpp / ctxgate names for "generate exactly max_tokens".
                    "ignore_eos": True,
                    "min_tokens": workload.output_tokens,
                }
                timing = await stream_chat(client, self.base_url, body)
                usage = timing.usage
                prompt_tokens = (usage or {}).get("prompt_tokens") or (
                    self.tokenizer.count_chat(messages) if self.tokenizer else 0
                )
                return RequestResult(
                    ttft_s=timing.ttft_s,
                    e2e_s=timing.e2e_s,
                    output_tokens=(usage or {}).get("completion_tokens") or timing.content_chunks,
                    prompt_tokens=prompt_tokens,
                )

            return await _closed_loop(
                conversations, workload.concurrency, one, f"{self.name} {workload.name}"
            )


_PROGRESS = {"enabled": True}


def set_progress(enabled: bool) -> None:
    """Progress bars per run (on stderr, only when it is a terminal); `--no-progress` turns them off."""
    _PROGRESS["enabled"] = enabled


async def _closed_loop(items: list, concurrency: int, one: Callable, label: str = "") -> list[RequestResult]:
    """`concurrency` clients, each sending its next request when the previous one finished."""
    import sys

    from tqdm import tqdm

    bar = tqdm(
        total=len(items),
        desc=label or "requests",
        unit="req",
        leave=False,
        disable=not (_PROGRESS["enabled"] and sys.stderr.isatty()),
    )
    try:
        results = await closed_loop(items, concurrency, one, on_result=lambda _: bar.update(1))
    finally:
        bar.close()
    return [r for r in results if r is not None]


class HFGenerateRunner:
    """Plain transformers `generate`, static batches of `concurrency` requests, greedy.

    Each batch starts when the previous one finished (what a simple server around `generate` does
    for `concurrency` closed-loop clients); a request's TTFT is its batch's first-token time.
    """

    name = "hf_generate"

    def __init__(
        self, model_dir: str, torch_dtype, tokenizer, num_threads: int | None = None, device: str = "cpu"
    ):
        import torch

        # The in-process engine leaves this thread one OpenMP thread (backend/platform/openmp.py); the
        # baseline gets the same thread count as the engine for the length of each run.
        self.num_threads = num_threads
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the weight-loading bar would clutter the report
        self.torch = torch
        self.device = torch.device(device)  # the engine's device: the baseline runs where it runs
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(self.device)
        self.model.eval()
        self.tokenizer = tokenizer
        self.pad_id = (
            tokenizer.hf.pad_token_id if tokenizer.hf.pad_token_id is not None else tokenizer.eos_token_id
        )

    def run(self, conversations: list[list[dict[str, str]]], workload: Workload) -> list[RequestResult]:
        prompts = [self.tokenizer.encode_chat(messages) for messages in conversations]
        if self.num_threads:
            self.torch.set_num_threads(self.num_threads)
        try:
            results = []
            for begin in range(0, len(prompts), workload.concurrency):
                batch = prompts[begin : begin + workload.concurrency]
                results.extend(self._run_batch(batch, workload.output_tokens))
            return results
        finally:
            if self.num_threads:
                from ctxgate.backend.platform import openmp

                openmp.hand_cores_to_engine()  # this thread's team would throttle the engine's

    def _run_batch(self, prompts: list[list[int]], output_tokens: int) -> list[RequestResult]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding, as decoder-only generation needs
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        token_times: list[float] = []
        start = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=output_tokens,
                min_new_tokens=output_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
                streamer=_TokenClock(token_times),
            )
        end = time.perf_counter()
        num_new = output.shape[1] - width
        first = token_times[0] if token_times else end
        return [
            RequestResult(
                ttft_s=first - start, e2e_s=end - start, output_tokens=num_new, prompt_tokens=len(p)
            )
            for p in prompts
        ]


class _TokenClock:
    """A `generate` streamer that only timestamps steps (HF's text streamers refuse batches).

    The first `put` carries the prompt; each later one the new token of every sequence."""

    def __init__(self, token_times: list[float]):
        self._token_times = token_times
        self._calls = 0

    def put(self, value) -> None:
        self._calls += 1
        if self._calls > 1:
            self._token_times.append(time.perf_counter())

    def end(self) -> None:
        pass


# ---------------------------------------------------------------------------- orchestration
@dataclass
class BenchOptions:
    workloads: list[str] = field(default_factory=lambda: ["W1", "W2", "W3"])
    num_requests: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    concurrency: int | None = None
    repeats: int = 1
    baseline: bool = True
    busy_threshold: float = 0.10
    max_attempts: int = 3
    seed: int = 0
    exclude_pids: list[int] = field(default_factory=list)


def measure(
    runner, conversations_for: Callable[[int], list], workload: Workload, options: BenchOptions, seed: int
) -> dict[str, Any]:
    """Run once; repeat (with fresh prompts) while other processes took more than the threshold."""
    attempts = []
    for attempt in range(options.max_attempts):
        conversations = conversations_for(seed * 1000 + attempt)
        meter = CpuMeter(options.exclude_pids)
        meter.start()
        start = time.perf_counter()
        results = runner.run(conversations, workload)
        duration = time.perf_counter() - start
        summary = summarize_run(results, duration, meter.stop())
        summary["attempt"] = attempt
        summary["busy_neighbour"] = summary["cpu"]["others_cpu_frac"] > options.busy_threshold
        attempts.append(summary)
        logger.info(
            "%s %s: %.1f out tok/s, others used %.0f%% of the CPU",
            workload.name,
            runner.name,
            summary["output_tok_s"],
            100 * summary["cpu"]["others_cpu_frac"],
        )
        if not summary["busy_neighbour"]:
            break
    best = min(attempts, key=lambda s: s["cpu"]["others_cpu_frac"])
    return {**best, "attempts": attempts}


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over repetitions of the headline numbers; every run is kept alongside."""
    if not runs:
        return {}

    def median_of(getter: Callable[[dict], float]) -> float:
        return statistics.median(getter(run) for run in runs)

    combined: dict[str, Any] = {
        "output_tok_s": median_of(lambda r: r["output_tok_s"]),
        "req_s": median_of(lambda r: r["req_s"]),
        "ttft_ms": {k: median_of(lambda r, k=k: r["ttft_ms"][k]) for k in ("p50", "p95", "p99", "mean")},
        "tpot_ms": {k: median_of(lambda r, k=k: r["tpot_ms"][k]) for k in ("p50", "p95", "p99", "mean")},
        "prompt_tokens_mean": median_of(lambda r: r["prompt_tokens_mean"]),
        "others_cpu_frac_max": max(r["cpu"]["others_cpu_frac"] for r in runs),
        "runs": runs,
    }
    return combined


def _ratios(engine: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {
        "output_tok_s": ratio(engine["output_tok_s"], baseline["output_tok_s"]),
        "req_s": ratio(engine["req_s"], baseline["req_s"]),
        # Latency ratios are baseline / engine, so > 1 means the engine is faster, like throughput.
        "ttft_p50_speedup": ratio(baseline["ttft_ms"]["p50"], engine["ttft_ms"]["p50"]),
        "ttft_p95_speedup": ratio(baseline["ttft_ms"]["p95"], engine["ttft_ms"]["p95"]),
        "tpot_p50_speedup": ratio(baseline["tpot_ms"]["p50"], engine["tpot_ms"]["p50"]),
    }


def run_benchmark(
    target,
    baseline,
    tokenizer,
    options: BenchOptions,
    report: Callable[[str], None] = print,
    peers: Sequence[Any] = (),
) -> dict[str, Any]:
    """Interleave target, peer and baseline runs for each selected workload; returns the JSON report.

    Each repetition runs the target, then every peer, then the baseline on the same prompts, so all
    see the same drift of the machine; ratios are the target's against each of the others."""
    report_data: dict[str, Any] = {"workloads": {}}
    for name in options.workloads:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        workload = scaled_workload(
            WORKLOADS[name],
            options.num_requests,
            options.prompt_tokens,
            options.output_tokens,
            options.concurrency,
        )

        def conversations_for(seed: int, workload: Workload = workload) -> list:
            return make_prompt_messages(tokenizer, workload, options.seed * 7919 + seed)

        others = [*peers, *([baseline] if baseline is not None else [])]
        runs: dict[str, list[dict[str, Any]]] = {runner.name: [] for runner in [target, *others]}
        for repeat in range(options.repeats):
            # A B C A B C ...: every system sees the same drift of the machine, and the same
            # prompts within a repetition (the seed is per repetition, not per system).
            for runner in [target, *others]:
                runs[runner.name].append(measure(runner, conversations_for, workload, options, repeat))
        entry: dict[str, Any] = {"workload": dataclasses.asdict(workload)}
        for runner_name, runner_runs in runs.items():
            entry[runner_name] = _combine(runner_runs)
        if baseline is not None:
            entry["ratios"] = _ratios(entry[target.name], entry[baseline.name])
        if peers:
            entry["ratios_vs"] = {peer.name: _ratios(entry[target.name], entry[peer.name]) for peer in peers}
        report_data["workloads"][name] = entry
        report(
            format_workload(
                entry,
                target.name,
                baseline.name if baseline is not None else None,
                [peer.name for peer in peers],
            )
        )
    return report_data


def format_workload(
    entry: dict[str, Any], target_name: str, baseline_name: str | None, peer_names: Sequence[str] = ()
) -> str:
    workload = entry["workload"]
    lines = [
        f"{workload['name']} {workload['description']}: {workload['num_requests']} requests, "
        f"~{workload['prompt_tokens']} prompt tokens, {workload['output_tokens']} output tokens, "
        f"concurrency {workload['concurrency']}",
        f"  {'system':<12} {'out tok/s':>9} {'req/s':>7}  {'TTFT ms p50 / p95 / p99':>26}  "
        f"{'TPOT ms p50 / p95 / p99':>24}  {'others CPU':>10}",
    ]
    for name in (target_name, *peer_names, baseline_name):
        if name is None:
            continue
        row = entry[name]
        ttft, tpot = row["ttft_ms"], row["tpot_ms"]
        lines.append(
            f"  {name:<12} {row['output_tok_s']:>9.1f} {row['req_s']:>7.3f}  "
            f"{ttft['p50']:>8.0f} / {ttft['p95']:>6.0f} / {ttft['p99']:>6.0f}  "
            f"{tpot['p50']:>7.1f} / {tpot['p95']:>6.1f} / {tpot['p99']:>6.1f}  "
            f"{100 * row['others_cpu_frac_max']:>9.0f}%"
        )
    comparisons = [
        (peer, entry["ratios_vs"][peer]) for peer in peer_names if peer in entry.get("ratios_vs", {})
    ]
    if "ratios" in entry:
        comparisons.append((baseline_name, entry["ratios"]))
    for other, ratios in comparisons:
        lines.append(
            f"  {target_name} vs {other}: output tok/s x{ratios['output_tok_s']:.2f}, "
            f"req/s x{ratios['req_s']:.2f}, TTFT P50 {ratios['ttft_p50_speedup']:.2f}x faster, "
            f"TTFT P95 {ratios['ttft_p95_speedup']:.2f}x faster, TPOT P50 {ratios['tpot_p50_speedup']:.2f}x faster"
        )
    return "\n".join(lines)


def write_report(report_data: dict[str, Any], out_dir: str | Path) -> Path:
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    target = out_path / "bench_engine.json"
    target.write_text(json.dumps(report_data, indent=2, default=str))
    return target
