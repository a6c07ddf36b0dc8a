"""`ctxgate bench prefill`: the prefill time a policy really saves, measured on the engine.

Each question goes twice through the gateway — full context (policy `passthrough`) and compressed
(policy P) — one request at a time, the order alternating per question (A B, B A, ...) so warm-up
and neighbour noise hit both arms alike. Every prompt starts with a unique tag, so no request is
served from the prefix cache. The engine's own `prefill_ms`/`ttft_ms` (usage.ctxgate)
give the saving per 1k prompt tokens removed, and a least-squares fit over every request gives the
cost model the gateway can use to estimate savings online:

    prefill_ms ≈ intercept_ms + ms_per_token * computed_prompt_tokens

where computed tokens are prompt tokens minus prefix-cache hits (cached tokens cost no prefill).
The model is written as JSON (schema `ctxgate.prefill_cost/v1`, see `cost_model_document`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import platform
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ctxgate.eval.client import GatewayClient
from ctxgate.eval.datasets import Dataset, EvalExample, load_dataset, resolve_dataset_path

COST_MODEL_SCHEMA = "ctxgate.prefill_cost/v1"


@dataclass
class LinearFit:
    intercept_ms: float
    ms_per_token: float
    r2: float
    n: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "intercept_ms": round(self.intercept_ms, 4),
            "ms_per_token": round(self.ms_per_token, 6),
            "r2": round(self.r2, 4),
            "n": self.n,
        }

    def predict(self, tokens: float) -> float:
        return self.intercept_ms + self.ms_per_token * tokens


def fit_linear(tokens: list[float], milliseconds: list[float]) -> LinearFit:
    """Ordinary least squares ms = a + b * tokens (needs two distinct token counts)."""
    x = np.asarray(tokens, dtype=float)
    y = np.asarray(milliseconds, dtype=float)
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("a linear fit needs at least two requests with different prompt lengths")
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (intercept + slope * x)
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float((residual**2).sum()) / total if total > 0 else 1.0
    return LinearFit(float(intercept), float(slope), r2, int(x.size))


def fit_quadratic(tokens: list[float], milliseconds: list[float]) -> dict[str, float] | None:
    """ms = a + b*t + c*t^2: attention makes long prefills superlinear; reported next to the linear
    model so a reader sees how far the linear one is from the curve (None with < 3 lengths)."""
    x = np.asarray(tokens, dtype=float)
    if np.unique(x).size < 3:
        return None
    c, b, a = np.polyfit(x, np.asarray(milliseconds, dtype=float), 2)
    return {
        "intercept_ms": round(float(a), 4),
        "ms_per_token": round(float(b), 6),
        "ms_per_token_squared": float(f"{c:.6g}"),
    }


def computed_tokens(sample: dict[str, Any]) -> float:
    return float(sample["prompt_tokens"]) - float(sample.get("cached_prompt_tokens") or 0)


def summarize_pairs(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Saving per 1k tokens removed, as a ratio of totals (robust) and a median of per-question rates."""
    removed = [p["full"]["prompt_tokens"] - p["compressed"]["prompt_tokens"] for p in pairs]
    summary: dict[str, Any] = {"pairs": len(pairs), "tokens_removed_mean": round(float(np.mean(removed)), 2)}
    for key in ("prefill_ms", "ttft_ms"):
        saved = [p["full"][key] - p["compressed"][key] for p in pairs]
        total_removed = sum(removed)
        summary[f"{key}_full_mean"] = round(float(np.mean([p["full"][key] for p in pairs])), 3)
        summary[f"{key}_compressed_mean"] = round(float(np.mean([p["compressed"][key] for p in pairs])), 3)
        summary[f"{key}_saved_mean"] = round(float(np.mean(saved)), 3)
        summary[f"{key}_saved_per_1k_tokens_removed"] = (
            round(1000 * sum(saved) / total_removed, 3) if total_removed > 0 else None
        )
        rates = [1000 * s / r for s, r in zip(saved, removed, strict=True) if r > 0]
        summary[f"{key}_saved_per_1k_tokens_removed_median"] = (
            round(float(np.median(rates)), 3) if rates else None
        )
    for arm in ("full", "compressed"):
        summary[f"cached_prompt_tokens_{arm}_mean"] = round(
            float(np.mean([p[arm].get("cached_prompt_tokens") or 0 for p in pairs])), 2
        )
    compression = [p["compressed"].get("compression_ms_total", 0.0) for p in pairs]
    summary["compression_ms_mean"] = round(float(np.mean(compression)), 3)
    # What the user gains: engine TTFT saved minus the time spent compressing (the full arm has none).
    summary["net_ttft_saved_ms_mean"] = round(
        summary["ttft_ms_saved_mean"] - summary["compression_ms_mean"], 3
    )
    return summary


def cost_model_document(
    samples: list[dict[str, Any]], model: str, policy: str, dataset: Dataset
) -> dict[str, Any]:
    tokens = [computed_tokens(sample) for sample in samples]
    prefill = fit_linear(tokens, [sample["prefill_ms"] for sample in samples])
    ttft = fit_linear(tokens, [sample["ttft_ms"] for sample in samples])
    return {
        "schema": COST_MODEL_SCHEMA,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": model,
        "host": {"machine": platform.machine(), "processor": platform.processor() or platform.machine()},
        "measured_with": {"dataset": dataset.path, "policy": policy, "requests": len(samples)},
        # ms = intercept_ms + ms_per_token * (prompt_tokens - cached_prompt_tokens)
        "prefill_ms": prefill.to_dict(),
        "ttft_ms": ttft.to_dict(),
        "prefill_ms_quadratic": fit_quadratic(tokens, [sample["prefill_ms"] for sample in samples]),
        "token_range": [min(tokens), max(tokens)],
    }


def scrambled_copy(example: EvalExample) -> EvalExample:
    """Same lengths, different text: every passage's words reversed."""
    passages = tuple(
        replace(passage, text=" ".join(reversed(passage.text.split())), sentences=())
        for passage in example.passages
    )
    return replace(
        example, id=f"warmup-{example.id}", question=f"(warm-up) {example.question}", passages=passages
    )


def _sample(chat: Any, arm: str, question_id: str) -> dict[str, Any] | None:
    usage = chat.usage_ctxgate or {}
    if chat.error or usage.get("prefill_ms") is None:
        return None
    return {
        "id": question_id,
        "arm": arm,
        "prompt_tokens": usage.get("prompt_tokens", chat.prompt_tokens),
        "original_prompt_tokens": usage.get("original_prompt_tokens"),
        "cached_prompt_tokens": usage.get("cached_prompt_tokens") or 0,
        "prefill_ms": float(usage["prefill_ms"]),
        "ttft_ms": float(usage.get("ttft_ms") or chat.ttft_ms or 0.0),
        "client_ttft_ms": chat.ttft_ms,
        "queue_ms": usage.get("queue_ms"),
        "compression_ms_total": round(sum(float(v) for v in (usage.get("compression_ms") or {}).values()), 3),
    }


async def _measure(
    url: str,
    dataset: Dataset,
    policy: str,
    full_policy: str,
    warmup: int,
    api_key: str | None,
    progress: bool,
) -> tuple[list[dict[str, Any]], list[str], str]:
    from tqdm.auto import tqdm

    client = GatewayClient(url, api_key=api_key)
    pairs: list[dict[str, Any]] = []
    errors: list[str] = []
    run_id = uuid.uuid4().hex[:8]
    try:
        model = await client.model()
        # Warm-up requests (first-call allocations, lazy imports) are not measured. They use
        # scrambled copies of the questions so no measured prompt finds its blocks in the prefix cache.
        for example in dataset.examples[:warmup]:
            await client.chat(
                scrambled_copy(example), policy, max_tokens=1, cache_buster=f"{uuid.uuid4().hex[:12]} warm-up"
            )
        for index, example in enumerate(
            tqdm(dataset.examples, desc="bench prefill", unit="q", disable=not progress)
        ):
            arms = [("full", full_policy), ("compressed", policy)]
            if index % 2:
                arms.reverse()
            pair: dict[str, Any] = {"id": example.id}
            for arm, policy_name in arms:
                # A fresh prefix per request: nothing measured comes from the prefix cache, whatever
                # this gateway served before (earlier runs, the eval, the other arm).
                # (the unique part first: the first KV block must already differ)
                buster = f"{uuid.uuid4().hex[:12]} bench {run_id} {index} {arm}"
                chat = await client.chat(example, policy_name, max_tokens=1, cache_buster=buster)
                sample = _sample(chat, arm, example.id)
                if sample is None:
                    errors.append(f"{example.id} {arm}: {chat.error or 'no prefill_ms in usage.ctxgate'}")
                else:
                    pair[arm] = sample
            if "full" in pair and "compressed" in pair:
                pairs.append(pair)
    finally:
        await client.close()
    return pairs, errors, model


def run_bench_prefill(
    dataset_path: str,
    policy: str,
    out_dir: str,
    url: str | None = None,
    limit: int | None = None,
    full_policy: str = "passthrough",
    warmup: int = 2,
    model: str | None = None,
    policy_dir: str | None = None,
    api_key: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    from ctxgate.eval.report import cpu_path_line
    from ctxgate.eval.server import GatewayProcess

    dataset = load_dataset(resolve_dataset_path(dataset_path), limit=limit)
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    if url:
        pairs, errors, model_name = asyncio.run(
            _measure(url, dataset, policy, full_policy, warmup, api_key, progress)
        )
    else:
        with GatewayProcess(policy_dir=policy_dir, model=model, log_path=target / "gateway.log") as local_url:
            pairs, errors, model_name = asyncio.run(
                _measure(local_url, dataset, policy, full_policy, warmup, api_key, progress)
            )
    if not pairs:
        raise RuntimeError("no request pair completed:\n" + "\n".join(errors[:10]))
    samples = [pair[arm] for pair in pairs for arm in ("full", "compressed")]
    cost_model = cost_model_document(samples, model_name, policy, dataset)
    result = {
        "policy": policy,
        "full_policy": full_policy,
        "dataset": dataset.path,
        "cpu_path": cpu_path_line(),
        "summary": summarize_pairs(pairs),
        "cost_model": cost_model,
        "errors": errors,
        "pairs": pairs,
    }
    (target / "prefill_cost.json").write_text(json.dumps(cost_model, indent=2))
    (target / "bench_prefill.json").write_text(json.dumps(result, indent=2))
    (target / "bench_prefill.md").write_text(render_markdown(result))
    return result


def render_markdown(result: dict[str, Any]) -> str:
    summary = result["summary"]
    prefill = result["cost_model"]["prefill_ms"]
    ttft = result["cost_model"]["ttft_ms"]
    return "\n".join(
        [
            f"# Prefill saved: `{result['policy']}` vs `{result['full_policy']}`",
            "",
            f"- Dataset: `{result['dataset']}`; {summary['pairs']} question pairs, interleaved, one request at a time",
            f"- Machine: {result.get('cpu_path', 'not recorded')}",
            f"- Tokens removed per request (mean): {summary['tokens_removed_mean']:.0f}",
            f"- Prefill ms: full {summary['prefill_ms_full_mean']:.1f} → compressed "
            f"{summary['prefill_ms_compressed_mean']:.1f}; saved {summary['prefill_ms_saved_mean']:.1f} ms "
            f"= {summary['prefill_ms_saved_per_1k_tokens_removed']} ms per 1k tokens removed "
            f"(median per question {summary['prefill_ms_saved_per_1k_tokens_removed_median']})",
            f"- Engine TTFT ms: full {summary['ttft_ms_full_mean']:.1f} → compressed "
            f"{summary['ttft_ms_compressed_mean']:.1f}; saved {summary['ttft_ms_saved_per_1k_tokens_removed']} "
            "ms per 1k tokens removed",
            f"- Compression time (mean, passages seen for the first time): {summary['compression_ms_mean']:.1f} ms; "
            f"net TTFT saved per request {summary['net_ttft_saved_ms_mean']:.1f} ms",
            f"- Cost model: prefill_ms = {prefill['intercept_ms']:.2f} + {prefill['ms_per_token']:.4f} × tokens "
            f"(R² {prefill['r2']:.3f}, n {prefill['n']}); "
            f"ttft_ms = {ttft['intercept_ms']:.2f} + {ttft['ms_per_token']:.4f} × tokens (R² {ttft['r2']:.3f})",
            f"- Errors: {len(result['errors'])}",
            "",
        ]
    )
