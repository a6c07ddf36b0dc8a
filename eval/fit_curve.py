"""`ctxgate eval fit-curve`: retention under fitting. A request that does not fit its tenant's
remaining tokens or spend, or the model's window, is compressed into a smaller prompt budget
(gateway/fit.py); this replays a dev set at budgets falling from the policy's normal one
(`max_input_tokens`) to its floor (`fit.min_context_tokens`), each applied exactly as the gateway
applies a fit (`Fit.apply`), and reports per budget the answer retention of the prompts sent (in
process, no generation: `ctxgate eval retention`'s harness), the prompt tokens and how many
questions the budget could not hold at all (their system prompt and question alone over it).

    ctxgate eval fit-curve --input nq-multidoc-dev.jsonl --policy rag-default --limit 20 --steps 4

The default budgets fall geometrically (each step the same fraction of the one before), so the
floor's end of the curve, where retention moves, gets as many points as the top.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ctxgate.compression.types import BudgetExceededError
from ctxgate.eval.datasets import load_dataset, resolve_dataset_path
from ctxgate.eval.retention import QuestionResult, RetentionHarness, split_examples, summarize
from ctxgate.gateway.fit import Fit
from ctxgate.policies.schema import Policy


def fit_budgets(policy: Policy, steps: int) -> list[int]:
    """`steps` prompt budgets from the policy's normal one down to its floor, geometrically spaced."""
    top, floor = policy.max_input_tokens, policy.fit.min_context_tokens
    if steps < 2 or floor >= top:
        return [top]
    factor = (floor / top) ** (1 / (steps - 1))
    budgets = [round(top * factor**step) for step in range(steps - 1)] + [floor]
    return sorted(set(budgets), reverse=True)


def fitted_policy(policy: Policy, budget: int) -> Policy:
    """The policy as a request fitted into `budget` prompt tokens runs under."""
    return Fit("quota", budget, policy.reserve_output_tokens, policy.max_input_tokens).apply(policy)


def run_fit_curve(
    datasets: Sequence[str],
    policy_name: str,
    steps: int = 4,
    limit: int | None = 20,
    split: str = "all",
    policy_dir: str | None = None,
    budgets: Sequence[int] | None = None,
    harness: RetentionHarness | None = None,
) -> dict[str, Any]:
    from ctxgate.policies.loader import load_policy_file, packaged_policy_dir

    directory = Path(policy_dir) if policy_dir else packaged_policy_dir()
    policy = load_policy_file(directory / f"{policy_name}.yaml")
    chosen = sorted(set(budgets), reverse=True) if budgets else fit_budgets(policy, steps)
    harness = harness or RetentionHarness()
    report: dict[str, Any] = {
        "policy": policy_name,
        "normal_budget": policy.max_input_tokens,
        "floor": policy.fit.min_context_tokens,
        "budgets": chosen,
        "split": split,
        "curves": {},
    }
    for name in datasets:
        dataset = load_dataset(resolve_dataset_path(name))
        examples = split_examples(dataset.examples, split)[:limit]
        points = []
        for index, budget in enumerate(chosen):
            # Retention only: the first budget sees the passages first, the others reuse its work.
            harness.first_sight = index == 0
            served, refused = _replay(harness, examples, fitted_policy(policy, budget))
            summary = summarize(served) if served else {"n": 0, "answer_retention": None}
            points.append(
                {
                    "budget": budget,
                    "refused": refused,
                    "prompt_tokens_mean": round(sum(r.sent_tokens for r in served) / len(served), 1)
                    if served
                    else None,
                    **{k: summary.get(k) for k in ("n", "n_scored", "answer_retention", "compression_ratio")},
                }
            )
        report["curves"][dataset.name] = points
    return report


def _replay(
    harness: RetentionHarness, examples: Sequence[Any], policy: Policy
) -> tuple[list[QuestionResult], int]:
    served: list[QuestionResult] = []
    refused = 0
    for example in examples:
        try:
            served.append(harness.run_one(example, policy))
        except BudgetExceededError:
            refused += 1
    return served, refused


def curve_table(report: dict[str, Any]) -> list[str]:
    """The curves as a Markdown table: one row per dataset and budget."""
    lines = [
        "| dataset | prompt budget | answer retention | scored | refused | prompt tokens (mean) | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for dataset, points in report["curves"].items():
        for point in points:
            retention = "–" if point["answer_retention"] is None else f"{point['answer_retention']:.3f}"
            lines.append(
                f"| {dataset} | {point['budget']} | {retention} | {point.get('n_scored') or 0} | "
                f"{point['refused']} | {point['prompt_tokens_mean']} | {point.get('compression_ratio')} |"
            )
    return lines
