"""`ctxgate eval retention`: the in-process harness scores what is really sent, per question."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ctxgate.eval.retention import parse_overrides, run_retention


def _tiny_dataset(tmp_path: Path) -> Path:
    """Three questions: the answer is in one passage among unrelated ones."""
    topics = ["rivers", "volcanoes", "glaciers", "deserts", "forests"]
    fillers = [
        " ".join(
            f"Sentence {k} about {topic}: {topic} shape the land in region {k} over many years."
            for k in range(6)
        )
        for topic in topics
    ]
    rows = []
    for index, (question, answer, fact) in enumerate(
        [
            (
                "When was the Eiffel Tower completed?",
                "1889",
                "The Eiffel Tower was completed in 1889 for the fair.",
            ),
            ("Who wrote Hamlet?", "Shakespeare", "Hamlet is a tragedy written by William Shakespeare."),
            ("What is the capital of Australia?", "Canberra", "Canberra is the capital city of Australia."),
        ]
    ):
        passages = [
            {"title": topic.title(), "text": filler} for topic, filler in zip(topics, fillers, strict=True)
        ]
        passages.insert(index + 1, {"title": "Fact", "text": fact + " " + fillers[index]})
        rows.append({"id": f"q{index}", "question": question, "answers": [answer], "passages": passages})
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_passthrough_keeps_everything_and_a_tight_budget_cuts(tmp_path):
    dataset = str(_tiny_dataset(tmp_path))
    full = run_retention([dataset], "passthrough", {})
    summary = next(iter(full["datasets"].values()))["summary"]
    assert summary["n"] == 3 and summary["answer_retention"] == 1.0
    assert summary["compression_ratio"] == 1.0

    tight = run_retention([dataset], "rag-default", parse_overrides(["documents.max_tokens=60"]))
    summary = next(iter(tight["datasets"].values()))["summary"]
    assert summary["compression_ratio"] > 3, summary  # the budget really cut the prompt
    assert summary["answer_retention"] >= 2 / 3, summary  # the fact sentence is what survives
    assert summary["compression_ms_p95"] > 0


def test_cli_writes_a_report(tmp_path):
    out = tmp_path / "retention.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxgate",
            "eval",
            "retention",
            "--input",
            str(_tiny_dataset(tmp_path)),
            "--policy",
            "passthrough",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (
        report["policy"] == "passthrough" and len(next(iter(report["datasets"].values()))["questions"]) == 3
    )
