"""`ctxgate eval shadow-agreement`: the shadowed policy derived from the operator's, the shadow summary's
counts, the shadow log read back, the report's figures, and the command end to end on the real model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ctxgate.eval.shadow_agreement import fill_from_log, read_shadow_log
from ctxgate.eval.shadow_agreement_report import QuestionAgreement, render_markdown, summarize
from ctxgate.eval.shadow_setup import (
    ShadowCounts,
    counts_of,
    policy_source,
    shadowed_policy,
    write_policy_dir,
)
from ctxgate.gateway.shadow.ledger import ShadowRecord
from ctxgate.gateway.shadow.log import log_line
from ctxgate.policies.loader import load_policy_file, packaged_policy_dir
from tests.eval.test_bench_slo import REPO_ROOT, town_dataset


def test_the_shadowed_policy_is_the_operators_with_a_shadow_section(tmp_path):
    source = policy_source("rag-default", None)
    assert source == packaged_policy_dir() / "rag-default.yaml"
    derived = shadowed_policy(source, "rag-default", {"sample_rate": 1, "timeout_s": 600})
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "rag-default.yaml").write_text("name: rag-default\ndocuments: {max_tokens: 10}\n")
    (mine / "other.yaml").write_text("name: other\n")
    assert policy_source("rag-default", mine) == mine / "rag-default.yaml"  # the operator's first
    directory = write_policy_dir(tmp_path / "out", mine, [derived])
    assert sorted(p.name for p in directory.iterdir()) == ["other.yaml", "rag-default.yaml"]
    policy = load_policy_file(directory / "rag-default.yaml")
    shipped = load_policy_file(source)
    assert policy.shadow.sample_rate == 1 and policy.shadow.timeout_s == 600
    assert policy.documents == shipped.documents and policy.extraction == shipped.extraction
    with pytest.raises(ValueError, match="'nope' not found"):
        policy_source("nope", mine)


def test_counts_since_an_earlier_reading_and_what_has_settled():
    summary = {
        "policies": [
            {
                "policy": "p",
                "sampled": 7,
                "comparisons": 3,
                "mean_agreement": 0.5,
                "dropped": {"busy": 2, "timeout": 1},
            },
            {"policy": "q", "sampled": 1, "comparisons": 1, "dropped": {}},
        ]
    }
    now = counts_of(summary, "p")
    assert (now.sampled, now.comparisons, now.settled) == (7, 3, 6)  # one still running
    earlier = ShadowCounts(sampled=2, comparisons=1, dropped={"busy": 1, "timeout": 1})
    assert now.since(earlier) == ShadowCounts(sampled=5, comparisons=2, dropped={"busy": 1})
    assert counts_of(summary, "absent") == ShadowCounts()


def _row(
    qid: str, retained: bool | None, agreement: float | None, live: bool, shadow: bool
) -> QuestionAgreement:
    return QuestionAgreement(
        question_id=qid,
        answers=["x"],
        answer_retained=retained,
        agreement=agreement,
        live_correct=live,
        shadow_correct=None if agreement is None else shadow,
    )


def test_summary_sets_agreement_beside_retention_and_splits_it_by_what_was_retained():
    rows = [
        _row("a", True, 1.0, True, True),
        _row("b", True, 0.5, False, True),
        _row("c", False, 0.0, False, True),
        _row("d", False, 0.2, False, False),
        _row("e", True, None, True, False),  # dropped: in retention, not in agreement
    ]
    rows[-1].dropped = "too_long"
    summary = summarize(rows, {"too_long": 1})
    assert summary["questions"] == 5 and summary["compared"] == 4
    assert summary["dropped"] == {"too_long": 1}
    assert summary["agreement"]["value"] == pytest.approx(0.425) and summary["agreement"]["n"] == 4
    assert (
        summary["answer_retention"]["value"] == pytest.approx(0.6) and summary["answer_retention"]["n"] == 5
    )
    assert summary["agreement_where_retained"]["value"] == pytest.approx(0.75)
    assert summary["agreement_where_lost"]["value"] == pytest.approx(0.1)
    assert summary["shadow_accuracy"]["value"] == pytest.approx(0.75)
    assert summary["live_accuracy"]["value"] == pytest.approx(0.25)
    assert summary["answer_kept_where_shadow_right"] == {
        "value": pytest.approx(1 / 3, abs=1e-3),
        "interval": [0.0, 1.0],
        "n": 3,
    }
    low, high = summary["agreement"]["interval"]
    assert 0.0 <= low <= 0.425 <= high <= 1.0
    report = {
        "policy": "rag-default",
        "questions_from": "nq.jsonl",
        "command": "ctxgate eval shadow-agreement",
        "split": "all",
        "shadow": {"sample_rate": 1},
        "max_tokens": 32,
        "comparison": "auto",
        "summary": summary,
    }
    markdown = render_markdown(report)
    assert "| shadow agreement (auto, the policy's measure) | 0.425" in markdown
    assert "| answer retention (offline: a gold answer in the compressed prompt) | 0.600" in markdown
    assert "dropped: too_long 1" in markdown and "| agreement where it was lost | 0.100" in markdown


def test_a_logged_comparison_fills_its_question(tmp_path):
    record = ShadowRecord(
        request_id="chatcmpl-1",
        tenant="-",
        policy="rag-default",
        model="m",
        comparison="token_f1",
        agreement=0.5,
        measures={"exact": 0.0, "token_f1": 0.5, "key_spans": 1.0, "json_fields": None},
        prompt_tokens_live=10,
        prompt_tokens_shadow=40,
        completion_tokens_live=2,
        completion_tokens_shadow=3,
        live_answer="Ida Holm",
        shadow_answer="Ida Holm is the mayor",
        at=0.0,
    )
    log = tmp_path / "shadow.jsonl"
    log.write_text(
        log_line(record, "Ida Holm", "Ida Holm is the mayor", {"live": "a", "shadow": "b"}) + "junk\n"
    )
    entries = read_shadow_log(log)
    assert list(entries) == ["chatcmpl-1"]
    row = QuestionAgreement(question_id="q", answers=["Ida Holm"])
    fill_from_log(row, entries["chatcmpl-1"])
    assert (row.agreement, row.exact, row.key_spans, row.shadow_correct) == (0.5, 0.0, 1.0, True)
    assert read_shadow_log(tmp_path / "absent.jsonl") == {}


# A policy that really cuts the town facts (about 200 tokens) without an embedding model.
TOWN_TIGHT = (
    "name: town-tight\nmax_input_tokens: 1024\nreserve_output_tokens: 16\ndocuments: {max_tokens: 60}\n"
    "rerank: {method: bm25, top_k: 2}\ndedup: {near_duplicate_cosine: null}\nextraction: {enabled: false}\n"
)


@pytest.mark.slow
def test_shadow_agreement_command_compares_every_question_and_scores_its_retention(tmp_path):
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "town-tight.yaml").write_text(TOWN_TIGHT)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "ctxgate", "eval", "shadow-agreement", "--input"]
    command += [
        str(town_dataset(tmp_path / "t.jsonl")),
        "--policy",
        "town-tight",
        "--policy-dir",
        str(policies),
    ]
    command += ["--limit", "3", "--max-tokens", "6", "--no-progress", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "shadow_agreement.json").read_text())
    assert report["policy"] == "town-tight" and report["shadow"]["sample_rate"] == 1
    assert report["policy_source"] == str(policies / "town-tight.yaml")
    summary = report["summary"]
    assert report["sampled"] == 3 and summary["compared"] == 3 and summary["dropped"] == {}
    assert summary["answer_retention"]["n"] == 3 and summary["agreement"]["n"] == 3
    logged = [json.loads(line) for line in (out / "shadow.jsonl").read_text().splitlines()]
    assert sorted(entry["request_id"] for entry in logged) == sorted(
        row["request_id"] for row in report["rows"]
    )
    for row in report["rows"]:
        assert row["prompt_tokens"] < row["original_prompt_tokens"]
        assert 0.0 <= row["agreement"] <= 1.0 and row["shadow_answer"] is not None
    assert "# Shadow agreement of town-tight" in (out / "shadow_agreement.md").read_text()
