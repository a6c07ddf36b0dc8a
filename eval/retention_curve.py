"""`ctxgate eval retention-curve`: the retention-vs-ratio curve of a ctxgate policy and, with
`--peer`, of another compressor's output (eval/peers/longllmlingua_peer.py) on the same questions.

    ctxgate eval retention-curve --peer OUT/longllmlingua.json --out OUT/ \
        --dataset nq-multidoc-dev.jsonl --dataset hotpotqa-distractor-dev.jsonl --limit 60

- ctxgate: `ctxgate eval retention`'s harness, in process, over a sweep of `documents.max_tokens`;
  the first budget is timed at first sight, the others reuse its embeddings (retention only).
- The peer: its compressed contexts are rendered into the messages ctxgate would send (same system
  prompt, same "Documents:/Question:" layout) and counted with ctxgate's tokenizer and chat template,
  so both ratios are original prompt tokens / sent prompt tokens, measured alike; retention is
  scored on those messages with eval/evidence.py.

Writes curve.json and retention_vs_ratio.png into --out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ctxgate.eval.client import question_messages
from ctxgate.eval.datasets import load_dataset, resolve_dataset_path
from ctxgate.eval.evidence import evidence_retention
from ctxgate.eval.retention import (
    RetentionHarness,
    policy_with_overrides,
    split_examples,
    summarize,
)

DEFAULT_BUDGETS = (1000, 700, 560, 400, 300, 200, 150, 100, 60)


def ctxgate_curve(
    harness: RetentionHarness, policy_name: str, dataset: str, split: str, limit: int, budgets: list[int]
) -> list[dict[str, Any]]:
    from ctxgate.policies.loader import load_policy_file, packaged_policy_dir

    base = load_policy_file(packaged_policy_dir() / f"{policy_name}.yaml")
    examples = [
        e
        for e in split_examples(load_dataset(resolve_dataset_path(dataset)).examples, split)
        if not e.is_yes_no
    ]
    examples = examples[:limit]
    points = []
    for index, budget in enumerate(budgets):
        harness.first_sight = index == 0  # time the first budget cold; the rest share its embeddings
        results = harness.run(examples, policy_with_overrides(base, {"documents.max_tokens": budget}))
        summary = summarize(results)
        if index > 0:
            for key in ("compression_ms_mean", "compression_ms_p50", "compression_ms_p95"):
                summary[key] = None  # warm caches: not a first-sight time
        retained = {r.id: r.answer_retained for r in results}
        points.append(
            {
                "budget": budget,
                **summary,
                "retained": retained,
                "ratios": {r.id: round(r.ratio, 3) for r in results},
            }
        )
    return points


def peer_curve(harness: RetentionHarness, peer: dict[str, Any], dataset: str) -> list[dict[str, Any]]:
    """The peer's rows re-rendered and re-counted with ctxgate's tokenizer, one point per target ratio."""
    from ctxgate.compression.rendering import question_with_context

    loaded = load_dataset(resolve_dataset_path(dataset))
    examples = {e.id: e for e in loaded.examples}
    rows = peer["datasets"].get(loaded.name, [])
    points = []
    for ratio in sorted({row["target_ratio"] for row in rows}):
        kept, originals, sents, times, cpu = [], [], [], [], []
        retained_by_id: dict[str, bool | None] = {}
        for row in (r for r in rows if r["target_ratio"] == ratio):
            example = examples[row["id"]]
            messages = question_messages(example)
            original = harness.request_of(example)
            full = [
                messages[0],
                {
                    "role": "user",
                    "content": question_with_context(
                        "\n\n".join(
                            f"[{i + 1}] {d.title}\n{d.text}" for i, d in enumerate(original.documents)
                        ),
                        example.question,
                    ),
                },
            ]
            sent = [
                messages[0],
                {
                    "role": "user",
                    "content": question_with_context(row["compressed_context"], example.question),
                },
            ]
            originals.append(harness.pipeline.counter.count_chat(full))
            sents.append(harness.pipeline.counter.count_chat(sent))
            retained = evidence_retention(example, sent).answer_retained
            retained_by_id[row["id"]] = retained
            if retained is not None:
                kept.append(retained)
            times.append(row["compression_ms"])
            cpu.append(row.get("compression_cpu_ms"))
        points.append(
            {
                "target_ratio": ratio,
                "n": len(times),
                "n_scored": len(kept),
                "answer_retention": round(sum(kept) / len(kept), 4) if kept else None,
                "compression_ratio": round(sum(originals) / sum(sents), 3) if sents else None,
                "compression_ms_mean": round(sum(times) / len(times), 1) if times else None,
                "compression_cpu_ms_mean": round(sum(c for c in cpu if c) / len(cpu), 1)
                if cpu and all(cpu)
                else None,
                "retained": retained_by_id,
            }
        )
    return points


def plot(curves: dict[str, dict[str, list[dict[str, Any]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    for axis, (dataset, arms) in zip(axes[0], curves.items(), strict=True):
        for label, points in arms.items():
            xs = [p["compression_ratio"] for p in points if p["answer_retention"] is not None]
            ys = [p["answer_retention"] for p in points if p["answer_retention"] is not None]
            n = max((p["n_scored"] for p in points), default=0)
            axis.plot(xs, ys, marker="o", label=f"{label} (n={n})")
        axis.set_xlim(1.5, 13)
        axis.set_ylim(0, 1.02)
        axis.set_xlabel("compression ratio (original / sent prompt tokens)")
        axis.set_ylabel("answer retention")
        axis.set_title(dataset)
        axis.grid(alpha=0.3)
        axis.legend(loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def run_retention_curve(
    datasets: list[str],
    out_dir: str | Path,
    policy: str = "rag-default",
    split: str = "test",
    limit: int = 60,
    budgets: list[int] | None = None,
    peer_path: str | None = None,
    reuse_path: str | None = None,
) -> dict[str, Any]:
    """Both curves per dataset; writes curve.json and retention_vs_ratio.png into `out_dir`.
    `reuse_path`: take the policy's points from an earlier curve.json instead of running it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    harness = RetentionHarness()
    peer = json.loads(Path(peer_path).read_text()) if peer_path else None
    budgets = list(budgets or DEFAULT_BUDGETS)
    reused = json.loads(Path(reuse_path).read_text())["curves"] if reuse_path else {}
    curves: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for dataset in datasets:
        name = load_dataset(resolve_dataset_path(dataset)).name
        points = reused.get(name, {}).get(policy)
        if points is None:
            points = ctxgate_curve(harness, policy, dataset, split, limit, budgets)
        curves[name] = {policy: points}
        if peer is not None:
            curves[name]["LongLLMLingua"] = peer_curve(harness, peer, dataset)
    report = {
        "policy": policy,
        "split": split,
        "budgets": budgets,
        "peer_meta": {k: v for k, v in (peer or {}).items() if k != "datasets"},
        "curves": curves,
    }
    (out / "curve.json").write_text(json.dumps(report, indent=1))
    plot(curves, out / "retention_vs_ratio.png")
    return report
