"""Report aggregation, Markdown, plots and the regression gate on scored rows.

The rows are built from real dataset questions with replies that are right or wrong by
construction, so every number in the report can be checked against a count.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ctxgate.eval.datasets import load_dataset, resolve_dataset_path
from ctxgate.eval.gate import run_gate
from ctxgate.eval.plots import write_plots
from ctxgate.eval.report import build_report, load_report, render_markdown, write_report_files
from ctxgate.eval.runner import score_record
from ctxgate.eval.sweep import plain_variants

REPO_ROOT = Path(__file__).resolve().parents[2]


def _rows(dataset, arm: str, correct_every: int, keep_every: int, sent_tokens: int):
    variant = plain_variants([arm])[0]
    rows = []
    for index, example in enumerate(dataset.examples):
        gold = example.gold_passages[0]
        distractor = next(passage for passage in example.passages if not passage.is_gold)
        passages = [gold.text] if index % keep_every == 0 else [distractor.text]
        sent = [
            {"role": "system", "content": "Answer."},
            {"role": "user", "content": "\n\n".join(passages) + "\n\n" + example.question},
        ]
        reply = example.answers[0] if index % correct_every == 0 else "I do not know"
        compressed = SimpleNamespace(messages=sent, report={}, error=None)
        chat = SimpleNamespace(
            reply=reply,
            error=None,
            prompt_tokens=sent_tokens,
            completion_tokens=4,
            ttft_ms=100.0 + index,
            tpot_ms=10.0,
            latency_ms=140.0 + index,
            usage_ctxgate={
                "original_prompt_tokens": 2000,
                "prompt_tokens": sent_tokens,
                "saved_tokens": {
                    "rerank": (2000 - sent_tokens) // 2,
                    "extraction": (2000 - sent_tokens) // 2,
                },
                "compression_ms": {"rerank": 3.0, "extraction": 2.0},
                "prefill_ms": sent_tokens / 10,
                "ttft_ms": sent_tokens / 10 + 5,
                "queue_ms": 1.0,
                "cached_prompt_tokens": 0,
            },
        )
        rows.append(score_record(example, variant, compressed, chat))
    return variant, rows


@pytest.fixture(scope="module")
def dataset():
    return load_dataset(resolve_dataset_path("nq-multidoc-dev.jsonl"), limit=40)


def _report(dataset, candidate_correct_every=2):
    base_variant, base_rows = _rows(dataset, "passthrough", correct_every=2, keep_every=1, sent_tokens=2000)
    cand_variant, cand_rows = _rows(
        dataset, "rag-default", correct_every=candidate_correct_every, keep_every=2, sent_tokens=500
    )
    config = SimpleNamespace(
        concurrency=1,
        sweep=None,
        policies=["passthrough", "rag-default"],
        limit=40,
        max_tokens=8,
        temperature=0.0,
        url="http://test",
        command="ctxgate eval run ...",
    )
    rows = base_rows + cand_rows
    return build_report(rows, [base_variant, cand_variant], dataset, config, wall_s=12.0), rows


def test_report_numbers_match_the_rows(dataset):
    report, _ = _report(dataset)
    base = report["arms"]["passthrough"]
    cand = report["arms"]["rag-default"]
    assert base["n"] == cand["n"] == 40 and base["errors"] == 0
    assert base["accuracy"]["value"] == pytest.approx(0.5)
    assert base["accuracy"]["ci_low"] < 0.5 < base["accuracy"]["ci_high"]
    assert base["answer_retention"]["value"] == 1.0 and cand["answer_retention"]["value"] == pytest.approx(
        0.5
    )
    assert cand["gold_passage_retention"]["value"] == pytest.approx(0.5)
    assert cand["compression_ratio"] == pytest.approx(4.0)
    assert cand["tokens_saved_by_stage"] == {"rerank": 750.0, "extraction": 750.0}
    assert cand["compression_ms"]["p50"] == pytest.approx(5.0)
    assert base["ttft_ms"]["p50"] == pytest.approx(119.5)
    [comparison] = report["comparisons"]
    retention_diff = comparison["difference"]["answer_retention"]
    assert retention_diff["value"] == pytest.approx(-0.5) and retention_diff["significant"]
    assert (
        comparison["difference"]["accuracy"]["value"] == 0
        and not comparison["difference"]["accuracy"]["significant"]
    )


def test_report_files_and_plots_are_written(dataset, tmp_path):
    report, rows = _report(dataset)
    report["plots"] = write_plots(report, rows, tmp_path)
    write_report_files(report, tmp_path)
    for name in ["report.json", "report.md", *report["plots"].values()]:
        assert (tmp_path / name).stat().st_size > 0, name
    for name in report["plots"].values():
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "report.md").read_text()
    assert "| rag-default |" in markdown and "real difference" in markdown
    assert load_report(tmp_path / "report.json")["arms"].keys() == {"passthrough", "rag-default"}
    assert render_markdown(report) == markdown


def test_gate_passes_identical_and_fails_planted_drop(dataset):
    report, _ = _report(dataset)
    assert run_gate(report, copy.deepcopy(report), 0.02, 0.02).passed
    dropped, _ = _report(dataset, candidate_correct_every=4)  # rag-default accuracy 0.5 -> 0.25
    result = run_gate(report, dropped, 0.02, 0.02)
    assert not result.passed
    [failure] = [check for check in result.checks if not check.passed]
    assert (failure.arm, failure.metric) == ("rag-default", "accuracy")
    assert failure.drop == pytest.approx(0.25)
    assert failure.drop_ci[0] > 0.02  # the interval of the drop excludes the allowed margin
    assert "rag-default: accuracy dropped by +0.250" in result.describe()
    # A generous margin lets the same drop through.
    assert run_gate(report, dropped, 0.3, 0.02).passed


def test_gate_flags_missing_arm_and_other_dataset(dataset):
    report, _ = _report(dataset)
    current = copy.deepcopy(report)
    del current["arms"]["rag-default"]
    current["dataset"]["sha256"] = "0" * 64
    result = run_gate(report, current, 0.02, 0.02)
    assert not result.passed
    assert any("arm missing" in problem for problem in result.problems)
    assert any("different datasets" in problem for problem in result.problems)


def test_gate_cli_exit_codes(dataset, tmp_path):
    report, _ = _report(dataset)
    dropped, _ = _report(dataset, candidate_correct_every=4)
    (tmp_path / "old.json").write_text(json.dumps(report))
    (tmp_path / "new.json").write_text(json.dumps(dropped))

    def gate(current: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "ctxgate",
                "eval",
                "gate",
                "--baseline",
                str(tmp_path / "old.json"),
                "--current",
                str(tmp_path / current),
                "--max-accuracy-drop",
                "0.02",
                "--max-retention-drop",
                "0.02",
            ],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=120,
        )

    same = gate("old.json")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "gate PASSED" in same.stdout
    regressed = gate("new.json")
    assert regressed.returncode == 1
    assert (
        "FAIL rag-default: accuracy dropped by +0.250" in regressed.stdout
        and "95% CI of drop" in regressed.stdout
    )
    missing = gate("absent.json")
    assert missing.returncode == 2 and "report not found" in missing.stderr
