"""ctxgate.eval.fit_scorer: what a sentence is labelled with, and the held-out check that picks the L2
strength, on real pipeline stages (embedder, tokenizer, rerank)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from ctxgate.eval.datasets import load_dataset
from ctxgate.eval.fit_scorer import kept_answer, main, question_rows
from ctxgate.eval.retention import RetentionHarness, policy_with_overrides
from ctxgate.policies.loader import load_policy_file, packaged_policy_dir

FILLER = " ".join(f"Line {k} says little about the weather in town {k}." for k in range(5))


def _dataset(tmp_path: Path, count: int = 1) -> Path:
    """The answer ("Casa Loma") is the title of one passage and in none of its sentences' text."""
    rows = []
    for index in range(count):
        passages = [{"title": f"Town {k}", "text": FILLER} for k in range(4)]
        passages.insert(
            2,
            {
                "title": "Casa Loma",
                "text": "It is a Gothic Revival mansion in midtown Toronto. "
                "It was built for a financier between 1911 and 1914.",
            },
        )
        rows.append(
            {
                "id": f"q{index}",
                "question": "Which mansion in Toronto was built for a financier?",
                "answers": ["Casa Loma"],
                "passages": passages,
            }
        )
    path = tmp_path / "titles.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def harness():
    return RetentionHarness()


def _rows(harness, tmp_path, keep_titles: bool, budget: int = 1000):
    example = load_dataset(_dataset(tmp_path)).examples[0]
    policy = policy_with_overrides(
        load_policy_file(packaged_policy_dir() / "rag-default.yaml"),
        {"rerank.top_k": None, "extraction.keep_titles": keep_titles, "documents.max_tokens": budget},
    )
    return asyncio.run(question_rows(harness, example, policy)), policy


def test_a_sentence_under_the_answers_title_holds_the_answer_when_titles_are_kept(harness, tmp_path):
    rows, _ = _rows(harness, tmp_path, keep_titles=True)
    titled = [
        label
        for label, (p, _, _) in zip(rows.labels, rows.positions, strict=True)
        if rows.passages_seen[p].title == "Casa Loma"
    ]
    assert titled == [1.0, 1.0] and rows.labels.sum() == 2

    untitled, _ = _rows(harness, tmp_path, keep_titles=False)
    assert untitled.labels.sum() == 0  # no sentence's own text names it


def test_kept_answer_runs_the_extractions_own_selection(harness, tmp_path):
    rows, policy = _rows(harness, tmp_path, keep_titles=True, budget=30)
    counter = harness.pipeline.counter
    toward = np.where(rows.labels > 0, 5.0, 0.0)
    assert kept_answer(rows, toward, counter, policy.extraction)
    assert not kept_answer(rows, -toward, counter, policy.extraction)  # the budget holds one sentence or two


def test_fit_writes_weights_for_every_feature(tmp_path):
    out = tmp_path / "weights.json"
    assert (
        main(["--input", str(_dataset(tmp_path, count=4)), "--ratios", "3", "--c", "10", "--out", str(out)])
        == 0
    )
    fitted = json.loads(out.read_text())
    assert fitted["split"] == "tune" and fitted["c"] == 10.0
    assert len(fitted["weights"]) == 12 and len(fitted["hop_weights"]) == 3
