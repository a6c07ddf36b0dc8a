"""Fit ctxgate.compression.learned's weights on the tune halves of the dev sets (never the test halves).

    python -m ctxgate.eval.fit_scorer --input nq-multidoc-dev.jsonl --input hotpotqa-distractor-dev.jsonl \
        --input musique-dev.jsonl --out weights.json

Each tune question goes through the pipeline's stages up to the rerank (every passage kept), at
each of the fixed ratios' documents budgets (the pre-filter's choice of embedded sentences depends
on the budget), and every live sentence becomes one row of ctxgate.compression.sentence_features, labelled
1 when keeping it keeps a gold answer in the prompt (ctxgate.eval.metrics.answer_in_text, the retention
check itself): the answer is in the sentence, or in its passage's title when the policy keeps
titles (a kept sentence is rendered under its title). A softmax over each question's sentences
(L2) is fitted with every dataset weighing the same; the L2 strength is the one whose weights, fitted
on one half of the tune questions, keep the most answers on the other half (each way round) when
the extraction's own selection (ctxgate.compression.extraction.select_sentences) spends the budget. The
weights are printed in ctxgate.compression.learned's form and written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ctxgate.compression.sentence_features import FEATURES, HOP_FEATURES
from ctxgate.eval.datasets import EvalExample, load_dataset, resolve_dataset_path
from ctxgate.eval.metrics import answer_in_text
from ctxgate.eval.retention import RetentionHarness, policy_with_overrides
from ctxgate.eval.splits import split_examples

# Stages run before the features are read: the ones before the extraction.
FEATURE_STAGES = ("retrieval", "message-context", "cost-check", "history", "dedup", "rerank")


@dataclass
class Question:
    """One question at one budget: its sentences' features, labels (holds an answer), token costs
    (with the joining space), passage indices and header costs, and the documents budget."""

    features: np.ndarray
    labels: np.ndarray
    costs: np.ndarray
    passages: np.ndarray
    headers: np.ndarray
    budget: int
    question: str = ""
    positions: list[tuple[int, int, str]] = field(default_factory=list)
    passages_seen: list[Any] = field(default_factory=list)
    answers: tuple[str, ...] = ()


async def question_rows(harness: RetentionHarness, example: EvalExample, policy: Any) -> Question:
    """Feature rows and labels of one question's live sentences under `policy`."""
    from ctxgate.compression.extraction import embed_units, sentence_units, unit_features
    from ctxgate.compression.rendering import passage_header_cost
    from ctxgate.compression.stages.base import StageContext
    from ctxgate.compression.stages.budget import documents_budget
    from ctxgate.compression.stages.prepare import ensure_candidates
    from ctxgate.compression.state import split_messages

    pipeline = harness.pipeline
    state = split_messages(harness.request_of(example), budget_tokens=policy.max_input_tokens)
    ctx = StageContext(policy=policy, counter=pipeline.counter, services=pipeline.services)
    for stage in pipeline.stages:
        if stage.name not in FEATURE_STAGES:
            break
        if stage.enabled(state, policy):
            await stage.run(state, ctx)
    if not state.passages:
        empty = np.zeros(0)
        return Question(np.zeros((0, len(FEATURES))), empty, empty, empty, empty, 0)
    ensure_candidates(ctx, state)
    question_vector = ctx.question_vector(state)
    units = sentence_units(state.passages)
    vectors, wanted = embed_units(
        units, state.passages, len(question_vector), pipeline.services.embedder.embed
    )
    features = unit_features(state.question_text, question_vector, state.passages, units, vectors, wanted)
    keep_titles = policy.extraction.keep_titles
    titled = {
        i
        for i, p in enumerate(state.passages)
        if keep_titles and answer_in_text(p.title or "", example.answers)
    }
    labels = np.array(
        [unit.passage_index in titled or answer_in_text(unit.text, example.answers) for unit in units],
        dtype=np.float64,
    )
    counter = pipeline.counter
    costs = np.array(counter.count_many([unit.text for unit in units]), dtype=np.float64) + 1
    headers = np.array(
        [
            passage_header_cost(counter.count, min(i + 1, 99), p, policy.extraction.keep_titles)
            for i, p in enumerate(state.passages)
        ],
        dtype=np.float64,
    )
    return Question(
        features,
        labels,
        costs,
        np.array([u.passage_index for u in units]),
        headers,
        documents_budget(state, ctx),
        state.question_text,
        [(u.passage_index, u.sentence_index, u.text) for u in units],
        list(state.passages),
        tuple(example.answers),
    )


def dataset_questions(
    harness: RetentionHarness, examples: Sequence[EvalExample], policy: Any, ratios: Sequence[float]
) -> list[Question]:
    questions = []
    for example in examples:
        for ratio in ratios:
            budget = harness.documents_budget_for(example, ratio)
            tuned = policy_with_overrides(policy, {"documents.max_tokens": budget})
            questions.append(asyncio.run(question_rows(harness, example, tuned)))
    return questions


def softmax_fit(groups: Sequence[tuple[np.ndarray, np.ndarray, float, np.ndarray]], c: float) -> np.ndarray:
    """Softmax over each question's sentences: maximise the log of the probability mass on the
    sentences holding the answer (what the knapsack's exp(score - best) values reward), L2 1/c.
    `groups`: (features, holds the answer, the question's weight, a fixed score added)."""
    from scipy.optimize import minimize

    total = sum(weight for _, _, weight, _ in groups)

    def loss(w: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = 0.5 / c * float(w @ w), w / c
        for features, positive, weight, offset in groups:
            scores = features @ w + offset
            p_all = np.exp(scores - scores.max())
            p_pos = p_all * positive
            z_all, z_pos = p_all.sum(), p_pos.sum()
            value -= weight / total * (np.log(z_pos) - np.log(z_all))
            grad -= weight / total * (p_pos @ features / z_pos - p_all @ features / z_all)
        return value, grad

    width = groups[0][0].shape[1]
    return minimize(loss, np.zeros(width), jac=True, method="L-BFGS-B").x


def fit_rounds(datasets: Sequence[list[Question]], c: float) -> tuple[np.ndarray, np.ndarray]:
    """Both rounds' weights: the first on the sentences' own features, then the hop features with
    the first round's scores held fixed. Every dataset weighs the same; questions whose context
    holds no answer teach nothing and are left out."""
    from ctxgate.compression.sentence_features import hop_features

    answered = [[q for q in questions if q.labels.any()] for questions in datasets]
    first = softmax_fit(
        [(q.features, q.labels > 0, 1.0 / len(qs), np.zeros(len(q.labels))) for qs in answered for q in qs], c
    )
    hops = []
    for qs in answered:
        for q in qs:
            offset = q.features @ first
            hops.append(
                (
                    hop_features(q.question, q.passages_seen, q.positions, offset),
                    q.labels > 0,
                    1.0 / len(qs),
                    offset,
                )
            )
    return first, softmax_fit(hops, c)


def final_scores(question: Question, first: np.ndarray, hop: np.ndarray) -> np.ndarray:
    from ctxgate.compression.sentence_features import hop_features

    offset = question.features @ first
    return offset + hop_features(question.question, question.passages_seen, question.positions, offset) @ hop


def kept_answer(question: Question, scores: np.ndarray, counter: Any, extraction: Any) -> bool:
    """The extraction's own selection (knapsack, fill, exact trim) with these scores: True when the
    rendered block holds a gold answer."""
    from ctxgate.compression.extraction import select_sentences
    from ctxgate.compression.rendering import render_context
    from ctxgate.compression.scoring import VALUE_TEMPERATURE, SentenceUnit, store_sentence_scores

    passages = copy.deepcopy(question.passages_seen)
    units = [
        SentenceUnit(p, s, text, float(VALUE_TEMPERATURE * score))
        for (p, s, text), score in zip(question.positions, scores, strict=True)
    ]
    store_sentence_scores(units, passages)
    select_sentences(units, passages, question.budget, counter, extraction)
    return answer_in_text(render_context(passages, extraction.keep_titles), question.answers)


def retention_by_ratio(
    questions: Sequence[Question], ratios: Sequence[float], score: Any, counter: Any, extraction: Any
) -> list[float]:
    """Share of questions (their rows are ratio-major per example) whose answer the selection keeps."""
    shares = []
    for ratio_index in range(len(ratios)):
        at = questions[ratio_index :: len(ratios)]
        shares.append(
            float(np.mean([q.labels.any() and kept_answer(q, score(q), counter, extraction) for q in at]))
        )
    return shares


def choose_c(
    datasets: Sequence[list[Question]],
    ratios: Sequence[float],
    grid: Sequence[float],
    counter: Any,
    extraction: Any,
) -> float:
    """The L2 strength whose weights, fitted on one half of the tune examples, keep the most answers
    on the other half (both ways round; mean over datasets and ratios)."""
    width = len(ratios)

    def half(questions: list[Question], which: int) -> list[Question]:
        return [q for k, q in enumerate(questions) if (k // width) % 2 == which]

    best_c, best_share = grid[0], -1.0
    for c in grid:
        shares = []
        for which in (0, 1):
            first, hop = fit_rounds([half(qs, 1 - which) for qs in datasets], c)
            for questions in datasets:
                shares += retention_by_ratio(
                    half(questions, which),
                    ratios,
                    lambda q, w=first, h=hop: final_scores(q, w, h),
                    counter,
                    extraction,
                )
        share = float(np.mean(shares))
        print(f"c={c:g}: held-out half of tune keeps {share:.4f}")
        if share > best_share:
            best_c, best_share = c, share
    return best_c


C_GRID = (10.0, 30.0, 100.0, 300.0)
FUSED = np.array([0.45, 0, 0.35, 1.0] + [0.0] * (len(FEATURES) - 4))  # extraction.scorer "fused"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", action="append", required=True, dest="datasets")
    parser.add_argument("--policy", default="rag-default")
    parser.add_argument("--ratios", default="3,5,10")
    parser.add_argument("--limit", type=int, help="first N tune questions per dataset")
    parser.add_argument(
        "--c", default="auto", help="inverse L2 strength, or 'auto': chosen on halves of the tune questions"
    )
    parser.add_argument("--cache", help="pickle of the feature rows (read if it exists, else written)")
    parser.add_argument("--out", help="write the weights here as JSON")
    args = parser.parse_args(argv)
    from ctxgate.policies.loader import load_policy_file, packaged_policy_dir

    policy = policy_with_overrides(
        load_policy_file(packaged_policy_dir() / f"{args.policy}.yaml"), {"rerank.top_k": None}
    )
    ratios = [float(r) for r in args.ratios.split(",")]
    cache = Path(args.cache) if args.cache else None
    harness = RetentionHarness()
    if cache is not None and cache.exists():
        with cache.open("rb") as handle:
            per_dataset = pickle.load(handle)
    else:
        per_dataset = {}
        for name in args.datasets:
            dataset = load_dataset(resolve_dataset_path(name))
            examples = [e for e in split_examples(dataset.examples, "tune") if not e.is_yes_no][: args.limit]
            per_dataset[dataset.name] = dataset_questions(harness, examples, policy, ratios)
        if cache is not None:
            with cache.open("wb") as handle:
                pickle.dump(per_dataset, handle)
    counter = harness.pipeline.counter
    datasets = list(per_dataset.values())
    c = choose_c(datasets, ratios, C_GRID, counter, policy.extraction) if args.c == "auto" else float(args.c)
    first, hop = fit_rounds(datasets, c)
    for name, questions in per_dataset.items():
        fused = retention_by_ratio(
            questions, ratios, lambda q: q.features @ FUSED, counter, policy.extraction
        )
        both = retention_by_ratio(
            questions, ratios, lambda q: final_scores(q, first, hop), counter, policy.extraction
        )
        for ratio, before, after in zip(ratios, fused, both, strict=True):
            print(
                f"{name} {ratio:g}x answer kept on tune (fitted on it): fused {before:.3f} learned {after:.3f}"
            )
    print("WEIGHTS = (" + ", ".join(f"{w:.4f}" for w in first) + ")")
    print("HOP_WEIGHTS = (" + ", ".join(f"{w:.4f}" for w in hop) + ")")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "weights": dict(zip(FEATURES, map(float, first), strict=True)),
                    "hop_weights": dict(zip(HOP_FEATURES, map(float, hop), strict=True)),
                    "datasets": list(per_dataset),
                    "ratios": ratios,
                    "c": c,
                    "split": "tune",
                },
                handle,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
