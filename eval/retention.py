"""`ctxgate eval retention`: answer retention, compression ratio and compression time per question,
in process (no gateway, no generation), for one policy and optional overrides.

Each question goes through `CompressionPipeline.run` exactly as the gateway would call it (system
prompt + question, the passages as documents, client text neutralised the same way), and is scored
on the messages the pipeline returns with the eval's own normalization (eval/evidence.py). Yes/no
answers are not scored. The time is the pipeline's wall time for a question whose passages it has
not seen before (first sight: the per-text caches are emptied before each question; the embedding
model itself is loaded before the clock starts).

Tuning and reporting use disjoint halves of a dataset (`--split tune|test`, eval/splits.py): whole
groups of questions that share a gold passage go to one half, so a test question never shares
evidence with a tune question.

`--ratios 3,5,10` measures at fixed compression ratios: each question's documents budget is set so
that its prompt is cut to 1/ratio of the original (the question and system prompt stay whole, the
passages block gets what is left), and each ratio is reported with a bootstrap interval, per hop
count. The first ratio is timed at first sight, the others reuse its embeddings.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ctxgate.eval.client import question_messages
from ctxgate.eval.datasets import EvalExample, load_dataset, resolve_dataset_path
from ctxgate.eval.evidence import evidence_retention
from ctxgate.eval.splits import SPLITS, hop_count, split_examples
from ctxgate.eval.stats import bootstrap_mean, percentile

__all__ = ["SPLITS", "split_examples"]


@dataclass
class QuestionResult:
    id: str
    answer_retained: bool | None  # None: yes/no answer, not scored
    gold_passages_retained: float | None
    original_tokens: int
    sent_tokens: int
    compression_ms: float
    stage_ms: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.original_tokens / max(1, self.sent_tokens)


def policy_with_overrides(policy: Any, overrides: dict[str, Any]) -> Any:
    """The policy with dotted-field overrides applied (the operator's harness may override any
    field, not only those a request may)."""
    from ctxgate.policies.loader import apply_overrides

    if not overrides:
        return policy
    permissive = policy.model_copy(update={"allow_request_overrides": list(overrides)})
    return apply_overrides(permissive, overrides).model_copy(
        update={"allow_request_overrides": policy.allow_request_overrides}
    )


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """['documents.max_tokens=200'] -> {'documents.max_tokens': 200} (values parsed as YAML)."""
    import yaml

    overrides: dict[str, Any] = {}
    for pair in pairs:
        dotted, separator, raw = pair.partition("=")
        if not separator or not dotted.strip():
            raise ValueError(f"override {pair!r} is not FIELD=VALUE")
        overrides[dotted.strip()] = yaml.safe_load(raw)
    return overrides


class RetentionHarness:
    """One pipeline (tokenizer and embedding model loaded once) for many runs."""

    def __init__(self, model: str | None = None, first_sight: bool = True):
        from ctxgate.backend.model.model_prepare import resolve_model_path
        from ctxgate.backend.model.tokenizer import load_tokenizer
        from ctxgate.compression.pipeline import CompressionPipeline
        from ctxgate.gateway.sanitize import Neutraliser

        self.tokenizer = load_tokenizer(str(resolve_model_path(model)))
        # The embedding model runs as in the gateway (GatewaySettings: one batching thread with one
        # OpenMP thread), so first-sight times are the gateway's, and a busy machine does not make
        # a two-thread team wait on a descheduled worker at every matmul.
        self.pipeline = CompressionPipeline(self.tokenizer, embed_batch_window_ms=0.0, embed_threads=1)
        self.neutraliser = Neutraliser(self.tokenizer)
        self.pipeline.services.embedder.embed(["warm-up"])  # model load is not compression time
        self.first_sight = first_sight

    def forget(self) -> None:
        """Empty the per-text caches (embeddings, sentence splits, token counts), so the next
        question is timed as a first sight even when an earlier run saw the same passages."""
        self.pipeline.forget_text_caches()

    def request_of(self, example: EvalExample) -> Any:
        from ctxgate.compression.types import CompressionInput, Document

        messages = [
            {"role": m["role"], "content": self.neutraliser.text(m["content"])}
            for m in question_messages(example)
        ]
        documents = [
            Document(
                text=self.neutraliser.document(d["text"]),
                id=d["id"],
                title=self.neutraliser.document(d["title"]),
            )
            for d in example.documents()
        ]
        return CompressionInput(messages=messages, documents=documents)

    def run_one(self, example: EvalExample, policy: Any) -> QuestionResult:
        request = self.request_of(example)
        if self.first_sight:
            self.forget()
        started = time.perf_counter()
        result = asyncio.run(self.pipeline.run(request, policy))
        elapsed_ms = (time.perf_counter() - started) * 1000
        retention = evidence_retention(example, result.messages)
        details: dict[str, Any] = {}
        for stage in result.stages:
            details.update({f"{stage.name}.{key}": value for key, value in stage.details.items()})
        return QuestionResult(
            id=example.id,
            answer_retained=retention.answer_retained,
            gold_passages_retained=retention.gold_passages_retained,
            original_tokens=result.original_prompt_tokens,
            sent_tokens=result.prompt_tokens,
            compression_ms=round(elapsed_ms, 3),
            stage_ms=result.compression_ms,
            details=details,
        )

    def run(self, examples: Sequence[EvalExample], policy: Any) -> list[QuestionResult]:
        return [self.run_one(example, policy) for example in examples]

    def documents_budget_for(self, example: EvalExample, ratio: float) -> int:
        """The documents budget that cuts this question's prompt to 1/ratio of the original: the
        original prompt over the ratio, less what is never cut (system prompt, question, the
        passages block's framing), as the pipeline lays the prompt out (placement "user")."""
        from ctxgate.compression.rendering import question_with_context

        request = self.request_of(example)
        system, question = request.messages[0], request.messages[1]["content"]
        context = "\n\n".join(
            f"[{i + 1}] {d.title}\n{d.text}" if d.title else f"[{i + 1}]\n{d.text}"
            for i, d in enumerate(request.documents)
        )
        count = self.pipeline.counter.count_chat
        original = count([system, {"role": "user", "content": question_with_context(context, question)}])
        pinned = count([system, {"role": "user", "content": question_with_context("x", question)}]) - 1
        return max(1, int(original / ratio) - pinned)

    def run_at_ratios(
        self, examples: Sequence[EvalExample], policy: Any, ratios: Sequence[float]
    ) -> dict[float, list[QuestionResult]]:
        """Each question at each ratio (its own documents budget); the first ratio at first sight,
        the others with its embeddings cached (retention only, their times are not first sight)."""
        results: dict[float, list[QuestionResult]] = {ratio: [] for ratio in ratios}
        first_sight = self.first_sight
        try:
            for example in examples:
                for index, ratio in enumerate(ratios):
                    self.first_sight = first_sight and index == 0
                    budget = self.documents_budget_for(example, ratio)
                    tuned = policy_with_overrides(policy, {"documents.max_tokens": budget})
                    results[ratio].append(self.run_one(example, tuned))
        finally:
            self.first_sight = first_sight
        return results


def summarize(results: Sequence[QuestionResult]) -> dict[str, Any]:
    scored = [r.answer_retained for r in results if r.answer_retained is not None]
    gold = [r.gold_passages_retained for r in results if r.gold_passages_retained is not None]
    original = sum(r.original_tokens for r in results)
    sent = sum(r.sent_tokens for r in results)
    times = np.array([r.compression_ms for r in results], dtype=np.float64)
    return {
        "n": len(results),
        "n_scored": len(scored),
        "answer_retention": round(sum(scored) / len(scored), 4) if scored else None,
        "gold_passage_retention": round(float(np.mean(gold)), 4) if gold else None,
        # Ratio of totals, as eval/report.py computes it.
        "compression_ratio": round(original / sent, 3) if sent else None,
        "compression_ratio_median": round(float(np.median([r.ratio for r in results])), 3)
        if results
        else None,
        "compression_ms_mean": round(float(times.mean()), 2) if results else None,
        "compression_ms_p50": round(percentile(times.tolist(), 50), 2) if results else None,
        "compression_ms_p95": round(percentile(times.tolist(), 95), 2) if results else None,
    }


def summarize_at_ratio(
    results: Sequence[QuestionResult], hops: dict[str, int], timed: bool, seed: int = 0
) -> dict[str, Any]:
    """One ratio's summary: answer retention with a 95% bootstrap interval, overall and per hop
    count; times only when they are first-sight times."""
    summary = summarize(results)
    if not timed:
        for key in ("compression_ms_mean", "compression_ms_p50", "compression_ms_p95"):
            summary[key] = None
    retained = [None if r.answer_retained is None else float(r.answer_retained) for r in results]
    summary["answer_retention_ci"] = bootstrap_mean(retained, seed=seed).to_dict()
    by_hops: dict[int, list[QuestionResult]] = {}
    for result in results:
        by_hops.setdefault(hops[result.id], []).append(result)
    summary["by_hops"] = {
        str(count): {
            "answer_retention_ci": bootstrap_mean(
                [None if r.answer_retained is None else float(r.answer_retained) for r in group], seed=seed
            ).to_dict(),
            "gold_passage_retention": summarize(group)["gold_passage_retention"],
            "compression_ratio": summarize(group)["compression_ratio"],
        }
        for count, group in sorted(by_hops.items())
    }
    return summary


def run_ratio_report(
    datasets: Sequence[str],
    policy_name: str,
    overrides: dict[str, Any],
    ratios: Sequence[float],
    splits: Sequence[str] = ("tune", "test"),
    limit: int | None = None,
    policy_dir: str | None = None,
    harness: RetentionHarness | None = None,
) -> dict[str, Any]:
    """Every dataset, every split, every ratio: the fixed-ratio report (yes/no questions, which a
    substring check cannot score, are left out)."""
    from ctxgate.policies.loader import load_policy_file, packaged_policy_dir

    directory = Path(policy_dir) if policy_dir else packaged_policy_dir()
    policy = policy_with_overrides(load_policy_file(directory / f"{policy_name}.yaml"), overrides)
    harness = harness or RetentionHarness()
    report: dict[str, Any] = {
        "policy": policy_name,
        "overrides": overrides,
        "ratios": list(ratios),
        "datasets": {},
    }
    for name in datasets:
        dataset = load_dataset(resolve_dataset_path(name))
        rows: dict[str, Any] = {}
        for split in splits:
            examples = [e for e in split_examples(dataset.examples, split) if not e.is_yes_no][:limit]
            hops = {e.id: hop_count(e) for e in examples}
            by_ratio = harness.run_at_ratios(examples, policy, ratios)
            rows[split] = {
                f"{ratio:g}": {
                    "summary": summarize_at_ratio(results, hops, timed=index == 0),
                    "questions": [
                        asdict(r) | {"ratio": round(r.ratio, 3), "hops": hops[r.id]} for r in results
                    ],
                }
                for index, (ratio, results) in enumerate(by_ratio.items())
            }
        report["datasets"][dataset.name] = rows
    return report


def ratio_table(report: dict[str, Any]) -> list[str]:
    """The fixed-ratio report as printable lines: dataset, split, target and reached ratio, answer
    retention [95% interval] (n), and per hop count."""
    lines = []
    for dataset, splits in report["datasets"].items():
        for split, by_ratio in splits.items():
            for target, row in by_ratio.items():
                summary = row["summary"]
                ci = summary["answer_retention_ci"]
                hops = " ".join(
                    f"{count}-hop {h['answer_retention_ci']['value']:.3f} (n={h['answer_retention_ci']['n']})"
                    for count, h in summary["by_hops"].items()
                    if h["answer_retention_ci"]["value"] is not None
                )
                value = (
                    "-"
                    if ci["value"] is None
                    else f"{ci['value']:.3f} [{ci['ci_low']:.3f}, {ci['ci_high']:.3f}]"
                )
                timing = (
                    ""
                    if summary["compression_ms_p50"] is None
                    else f" first-sight ms p50 {summary['compression_ms_p50']}"
                )
                lines.append(
                    f"{dataset} {split} {target}x (reached {summary['compression_ratio']}x): answer retained "
                    f"{value} n={ci['n']}; {hops}{timing}"
                )
    return lines


def run_retention(
    datasets: Sequence[str],
    policy_name: str,
    overrides: dict[str, Any],
    split: str = "all",
    limit: int | None = None,
    policy_dir: str | None = None,
    harness: RetentionHarness | None = None,
) -> dict[str, Any]:
    from ctxgate.policies.loader import load_policy_file, packaged_policy_dir

    directory = Path(policy_dir) if policy_dir else packaged_policy_dir()
    policy = policy_with_overrides(load_policy_file(directory / f"{policy_name}.yaml"), overrides)
    harness = harness or RetentionHarness()
    report: dict[str, Any] = {"policy": policy_name, "overrides": overrides, "split": split, "datasets": {}}
    for name in datasets:
        dataset = load_dataset(resolve_dataset_path(name))
        examples = split_examples(dataset.examples, split)[:limit]
        results = harness.run(examples, policy)
        report["datasets"][dataset.name] = {
            "summary": summarize(results),
            "questions": [asdict(r) | {"ratio": round(r.ratio, 3)} for r in results],
        }
    return report


def write_json(report: dict[str, Any], path: str | Path) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=1, ensure_ascii=False))
