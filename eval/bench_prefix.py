"""`ctxgate bench prefix`: does the engine's prefix cache hit across compressed prompts?

Real RAG traffic repeats popular passages. The workload gives every request half of its passages
from its own question (the gold one always among them) and half drawn from a small pool of passages
every request may get, shuffled. Two assemblies of the same compressing policy run interleaved
request by request on one gateway: the policy's own order (`best-first` for rag-default) and
`stable` (canonical order by passage content). Each arm has a system prompt of its own, constant
within the arm (as an application's is), so the arms never share blocks with each other. The hit
rate is the engine's: the change of `prefix_cache_hits` / `prefix_cache_queries` (in /metrics)
over each arm's requests.

Retention — the gold answer string still in the sent prompt — is compared on more questions through
/v1/ctxgate/compress: the stable order must not lose answers (it only moves passages).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from ctxgate.eval.client import SYSTEM_PROMPT, ctxgate_extra
from ctxgate.eval.datasets import EvalExample, load_dataset, resolve_dataset_path
from ctxgate.eval.evidence import messages_text
from ctxgate.eval.metrics import answer_in_text

METRIC = re.compile(r"^ctxgate:prefix_cache_(queries|hits)_total\{[^}]*\}\s+([0-9.eE+-]+)$", re.MULTILINE)


def recurring_workload(examples: list[EvalExample], pool_size: int = 8, seed: int = 0) -> list[EvalExample]:
    """Each example keeps half its passages (gold first) and gets as many from a shared pool."""
    rng = random.Random(seed)
    pool = [p for example in examples[-pool_size:] for p in example.passages if not p.is_gold][
        : pool_size * 2
    ]
    out = []
    for example in examples[:-pool_size] if len(examples) > pool_size else examples:
        own = sorted(example.passages, key=lambda p: not p.is_gold)[: max(1, len(example.passages) // 2)]
        shared = rng.sample(pool, min(len(pool), len(example.passages) - len(own)))
        passages = own + shared
        rng.shuffle(passages)
        out.append(replace(example, passages=tuple(passages)))
    return out


def stable_variant(policy_name: str) -> dict[str, Any]:
    """The packaged policy with `assembly.order: stable`, under a name of its own."""
    from ctxgate.policies.loader import packaged_policy_dir

    policy = yaml.safe_load((packaged_policy_dir() / f"{policy_name}.yaml").read_text())
    policy["name"] = f"{policy_name}-stable"
    policy["assembly"] = {**(policy.get("assembly") or {}), "order": "stable"}
    return policy


def prefix_counters(metrics_text: str) -> dict[str, float]:
    counters = {"queries": 0.0, "hits": 0.0}
    for name, value in METRIC.findall(metrics_text):
        counters[name] += float(value)
    return counters


async def measure_hits(
    url: str, model: str, workload: list[EvalExample], arms: dict[str, str]
) -> dict[str, Any]:
    """Interleaved requests (1 output token); each arm's share of the engine's prefix-cache counters."""
    totals = {arm: {"queries": 0.0, "hits": 0.0, "requests": 0} for arm in arms}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for index, example in enumerate(workload):
            order = list(arms) if index % 2 == 0 else list(arms)[::-1]
            for arm in order:
                before = prefix_counters((await client.get("/metrics")).text)
                body = {
                    "model": model,
                    "max_tokens": 1,
                    "temperature": 0,
                    "messages": [
                        {"role": "system", "content": f"[app {arm}] {SYSTEM_PROMPT}"},
                        {"role": "user", "content": example.question},
                    ],
                    **ctxgate_extra(example, arms[arm]),
                }
                (await client.post("/v1/chat/completions", json=body)).raise_for_status()
                after = prefix_counters((await client.get("/metrics")).text)
                for key in ("queries", "hits"):
                    totals[arm][key] += after[key] - before[key]
                totals[arm]["requests"] += 1
    for row in totals.values():
        row["hit_rate"] = round(row["hits"] / row["queries"], 4) if row["queries"] else None
    return totals


async def measure_retention(
    url: str, model: str, examples: list[EvalExample], arms: dict[str, str]
) -> dict[str, Any]:
    retained = {arm: 0 for arm in arms}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for example in examples:
            for arm, policy in arms.items():
                body = {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": example.question},
                    ],
                    **ctxgate_extra(example, policy),
                }
                response = await client.post("/v1/ctxgate/compress", json=body)
                response.raise_for_status()
                retained[arm] += answer_in_text(messages_text(response.json()["messages"]), example.answers)
    return {arm: round(count / len(examples), 4) for arm, count in retained.items()} | {
        "questions": len(examples)
    }


def run_bench_prefix(
    dataset: str, policy: str, limit: int, retention_limit: int, out_dir: str | Path, model: str | None = None
) -> dict[str, Any]:
    from ctxgate.eval.report import cpu_path_line
    from ctxgate.eval.server import GatewayProcess

    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    policy_dir = target / "policies"
    policy_dir.mkdir(exist_ok=True)
    stable = stable_variant(policy)
    (policy_dir / f"{stable['name']}.yaml").write_text(yaml.safe_dump(stable))
    arms = {"policy order": policy, "stable": stable["name"]}
    data = load_dataset(resolve_dataset_path(dataset), limit=max(limit, retention_limit))
    workload = recurring_workload(data.examples[: limit + 8])
    with GatewayProcess(
        policy_dir=policy_dir,
        model=model,
        log_path=target / "gateway.log",
        env={"REDIS_URL": None, "CTXGATE_EMBED_CACHE_URL": None},
    ) as url:
        model_name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        hits = asyncio.run(measure_hits(url, model_name, workload, arms))
        retention = asyncio.run(measure_retention(url, model_name, data.examples[:retention_limit], arms))
    report = {
        "schema": "ctxgate.bench_prefix/v1",
        "dataset": data.path,
        "policy": policy,
        "requests_per_arm": len(workload),
        "cpu_path": cpu_path_line(),
        "prefix_cache": hits,
        "retention": retention,
        "retention_drop": round(retention["policy order"] - retention["stable"], 4),
    }
    (target / "bench_prefix.json").write_text(json.dumps(report, indent=2))
    (target / "bench_prefix.md").write_text(render_markdown(report))
    return report


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Prefix-cache reuse across compressed prompts (`{report['policy']}`)",
        "",
        f"- Dataset `{report['dataset']}`; {report['requests_per_arm']} requests per arm, half of each "
        "request's passages from a shared pool, arms interleaved, 1 output token",
        f"- CPU path: {report['cpu_path']}",
        "",
        "| assembly | requests | prompt tokens looked up | hits | hit rate | answer retention |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for arm, row in report["prefix_cache"].items():
        lines.append(
            f"| {arm} | {row['requests']} | {row['queries']:.0f} | {row['hits']:.0f} | "
            f"{row['hit_rate']} | {report['retention'][arm]} |"
        )
    lines += [
        "",
        f"Retention on {report['retention']['questions']} questions via /v1/ctxgate/compress; "
        f"drop with the stable assembly: {report['retention_drop']}",
        "",
    ]
    return "\n".join(lines)
