"""`ctxgate eval run`: every question through the real gateway, once per policy arm.

Per question and arm the runner asks the gateway what it would send (POST /v1/ctxgate/compress, for
evidence retention), then runs the streamed chat completion (reply, client TTFT/TPOT/latency, and
the gateway's `usage.ctxgate`). Arms are interleaved question by question (A B A B ...) so that a
noisy neighbour on the machine hits every arm alike.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxgate.eval.client import ChatOutcome, GatewayClient
from ctxgate.eval.datasets import Dataset, EvalExample, load_dataset, resolve_dataset_path
from ctxgate.eval.evidence import evidence_retention
from ctxgate.eval.loadgen import closed_loop
from ctxgate.eval.metrics import answer_in_text, exact_match, token_f1
from ctxgate.eval.status import Status, StatusLine, count
from ctxgate.eval.sweep import PolicyVariant, SweepSpec, build_sweep_variants, plain_variants


@dataclass
class RunConfig:
    dataset: str
    policies: list[str]
    out_dir: str
    limit: int | None = None
    concurrency: int = 1
    url: str | None = None
    max_tokens: int = 32
    temperature: float = 0.0
    sweep: SweepSpec | None = None
    policy_dir: str | None = None
    model: str | None = None
    api_key: str | None = None
    progress: bool = True
    # Only ask the gateway what it would send (no generation): retention and tokens, in seconds.
    compress_only: bool = False
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def score_record(
    example: EvalExample, variant: PolicyVariant, compressed: Any, chat: Any | None
) -> dict[str, Any]:
    """One results.jsonl row: what was sent, what came back, and its scores. `chat` is None in
    compress-only runs: answer scores and latencies are then None (not measured), not zero."""
    generated = chat is not None
    chat = chat if chat is not None else ChatOutcome(reply="")
    usage = chat.usage_ctxgate or {}
    report = compressed.report or {}
    retention = evidence_retention(example, compressed.messages) if not compressed.error else None
    reply = chat.reply
    scores = (
        _answer_scores(example, reply, chat.error)
        if generated
        else {"correct": None, "exact_match": None, "f1": None}
    )
    return {
        "id": example.id,
        "arm": variant.label,
        "policy": variant.policy,
        "base_policy": variant.base_policy,
        "sweep_field": variant.sweep_field,
        "sweep_value": variant.sweep_value,
        "question": example.question,
        "answers": list(example.answers),
        "reply": reply,
        **scores,
        **(
            retention.to_dict()
            if retention
            else {
                "answer_retained": None,
                "gold_passages_retained": None,
                "supporting_sentences_retained": None,
            }
        ),
        "sent_messages": compressed.messages,
        "original_prompt_tokens": usage.get("original_prompt_tokens", report.get("original_prompt_tokens")),
        "prompt_tokens": usage.get("prompt_tokens", chat.prompt_tokens or report.get("prompt_tokens")),
        "completion_tokens": chat.completion_tokens,
        "saved_tokens": usage.get("saved_tokens") or report.get("saved_tokens") or {},
        "compression_ms": usage.get("compression_ms") or report.get("compression_ms") or {},
        # The compress call sees each passage first (cold embedding caches); the chat call after it
        # is warm. Both are kept: online traffic sees a mix.
        "compression_ms_first_sight": (
            round(sum(float(ms) for ms in (report.get("compression_ms") or {}).values()), 3)
            if not compressed.error
            else None
        ),
        "queue_ms": usage.get("queue_ms"),
        "prefill_ms": usage.get("prefill_ms"),
        "server_ttft_ms": usage.get("ttft_ms"),
        "cached_prompt_tokens": usage.get("cached_prompt_tokens"),
        "ttft_ms": chat.ttft_ms,
        "tpot_ms": chat.tpot_ms,
        "latency_ms": chat.latency_ms,
        "error": chat.error or compressed.error,
    }


def _answer_scores(example: EvalExample, reply: str, error: str | None) -> dict[str, Any]:
    # A failed request is a wrong answer: dropping it would flatter a policy that fails often.
    if error:
        return {"correct": False, "exact_match": False, "f1": 0.0}
    return {
        "correct": answer_in_text(reply, example.answers),
        "exact_match": exact_match(reply, example.answers),
        "f1": round(token_f1(reply, example.answers), 4),
    }


async def _run_one(
    client: GatewayClient, example: EvalExample, variant: PolicyVariant, config: RunConfig
) -> dict[str, Any]:
    overrides = variant.overrides or None
    compressed = await client.compress(example, variant.policy, overrides)
    if config.compress_only:
        return score_record(example, variant, compressed, None)
    chat = await client.chat(example, variant.policy, config.max_tokens, overrides, config.temperature)
    return score_record(example, variant, compressed, chat)


async def run_against(
    url: str,
    dataset: Dataset,
    variants: list[PolicyVariant],
    config: RunConfig,
    status: StatusLine | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """All (question, arm) pairs with at most `concurrency` in flight; returns rows in submission
    order and the wall time."""
    from tqdm.auto import tqdm

    client = GatewayClient(url, api_key=config.api_key)
    jobs = [(example, variant) for example in dataset.examples for variant in variants]
    (status or Status())(
        f"{count(len(dataset.examples), 'question')} x {count(len(variants), 'arm')} = "
        f"{count(len(jobs), 'request')}, "
        f"{config.concurrency} at a time; the first ones wait for the gateway's embedding model "
        "if it is still loading"
    )
    progress = tqdm(total=len(jobs), desc=f"eval {dataset.name}", unit="req", disable=not config.progress)

    async def one(job: tuple[EvalExample, PolicyVariant]) -> dict[str, Any]:
        return await _run_one(client, job[0], job[1], config)

    def done(row: dict[str, Any]) -> None:
        progress.update(1)
        if row["error"]:
            progress.set_postfix_str(f"last error: {row['error'][:60]}")

    started = time.perf_counter()
    try:
        await client.model()  # fail fast (and once) if the gateway is not reachable
        results = await closed_loop(jobs, config.concurrency, one, on_result=done)
    finally:
        progress.close()
        await client.close()
    wall_s = time.perf_counter() - started
    return results, wall_s


def build_variants(config: RunConfig, temp_policy_dir: Path | None) -> list[PolicyVariant]:
    if not config.policies:
        raise ValueError("give at least one --policy")
    if len(set(config.policies)) != len(config.policies):
        raise ValueError("a --policy is repeated")
    if config.sweep is None:
        return plain_variants(config.policies)
    # The first policy is the baseline arm; the sweep derives variants of the last one.
    base = config.policies[-1]
    baseline = plain_variants(config.policies[:-1])
    return baseline + build_sweep_variants(config.sweep, base, config.policy_dir, temp_policy_dir)


def write_results(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


# (policy_dir, log_path) -> a context manager that serves a gateway and yields its URL.
GatewayLauncher = Callable[[str | None, Path], AbstractContextManager[str]]


def subprocess_launcher(model: str | None, status: StatusLine | None = None) -> GatewayLauncher:
    from ctxgate.eval.server import GatewayProcess

    def launch(policy_dir: str | None, log_path: Path) -> AbstractContextManager[str]:
        return GatewayProcess(policy_dir=policy_dir, model=model, log_path=log_path, status=status)

    return launch


def run_eval(
    config: RunConfig, launcher: GatewayLauncher | None = None, status: StatusLine | None = None
) -> dict[str, Any]:
    """Run, then write results.jsonl, report.json, report.md and plots into `out_dir`.

    Without `config.url` a gateway is started for the run: by default `ctxgate serve` as a child
    process; `launcher` can serve it differently (e.g. in this process, sharing a loaded engine).
    Each step is reported on `status` (default: a line on stderr)."""
    from ctxgate.eval.plots import write_plots
    from ctxgate.eval.report import build_report, write_report_files

    if config.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    if config.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    say = status or Status()
    path = resolve_dataset_path(config.dataset)
    say(f"reading the dataset {path}")
    dataset = load_dataset(path, limit=config.limit)
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="ctxgate-eval-policies-") as temp_dir:
        if config.url:
            variants = build_variants(config, None)
            say(f"using the running gateway at {config.url}")
            rows, wall_s = asyncio.run(run_against(config.url, dataset, variants, config, say))
        else:
            needs_dir = config.sweep is not None
            variants = build_variants(config, Path(temp_dir) if needs_dir else None)
            policy_dir = temp_dir if needs_dir else config.policy_dir
            launch = launcher or subprocess_launcher(config.model, say)
            with launch(policy_dir, out_dir / "gateway.log") as url:
                rows, wall_s = asyncio.run(run_against(url, dataset, variants, config, say))
            say("gateway stopped")

    say(f"{count(len(rows), 'request')} in {wall_s:.1f} s; writing the report and plots into {out_dir}")
    write_results(rows, out_dir / "results.jsonl")
    report = build_report(rows, variants, dataset, config, wall_s)
    report["plots"] = write_plots(report, rows, out_dir)
    write_report_files(report, out_dir)
    return report
