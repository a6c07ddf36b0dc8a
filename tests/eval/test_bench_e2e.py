"""`ctxgate bench e2e`: the summaries on hand-made samples, and the real command on 2 questions
(real gateway and engine server processes, 4 output tokens, one pass)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eval.bench_e2e import (
    TAG_PLACEHOLDER,
    ArmRun,
    Sample,
    acceptance,
    compression_payback,
    new_tag,
    summarize_arm,
    tagged,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def sample(arm: str, question: str, prefill_ms: float | None, compression_ms: float | None = None,
           ttft_ms: float = 100.0, e2e_ms: float = 400.0) -> Sample:
    return Sample(arm=arm, pass_name="cold", concurrency=1, question_id=question, ttft_ms=ttft_ms,
                  e2e_ms=e2e_ms, output_tokens=4, prompt_tokens=100, prefill_ms=prefill_ms,
                  compression_ms=compression_ms)


def test_tag_swap_keeps_prompt_length_and_replaces_every_placeholder():
    messages = [{"role": "system", "content": f"[{TAG_PLACEHOLDER}] answer"}, {"role": "user", "content": "q"}]
    tag = new_tag()
    swapped = tagged(messages, tag)
    assert len(tag) == len(TAG_PLACEHOLDER)
    assert swapped[0]["content"] == f"[{tag}] answer" and swapped[1] == messages[1]
    assert TAG_PLACEHOLDER in messages[0]["content"]  # the fetched messages are reused, never mutated


def test_arm_summary_counts_requests_over_summed_wall_time_and_skips_errors():
    ok = [sample("full", "a", 10.0), sample("full", "b", 20.0)]
    failed = Sample("full", "cold", 1, "c", 0.0, 0.0, 0, 0, error="HTTP 500")
    runs = [ArmRun("full", ok[:1], 2.0, 0.1), ArmRun("full", [ok[1], failed], 3.0, 0.3)]
    row = summarize_arm(runs)
    assert row["requests"] == 2 and row["errors"] == 1
    assert row["req_s"] == pytest.approx(2 / 5.0)
    assert row["output_tok_s"] == pytest.approx(8 / 5.0)
    assert row["tpot_ms"]["p50"] == pytest.approx(100.0)  # (400 - 100) / (4 - 1)
    assert row["others_cpu_frac_max"] == pytest.approx(0.3)


def test_arm_summary_breaks_compression_time_down_by_stage():
    samples = [sample("compressed", q, 100.0) for q in "abc"]
    for index, one in enumerate(samples):
        one.compression_stage_ms = {"dedup": 100.0 * (index + 1), "rerank": 20.0, "history": 0.01}
    stages = summarize_arm([ArmRun("compressed", samples, 1.0, 0.0)])["compression_stage_ms"]
    assert stages["dedup"]["p50"] == pytest.approx(200.0)
    assert stages["rerank"]["p95"] == pytest.approx(20.0)
    assert "history" not in stages  # stages that cost nothing are left out of the report


def test_payback_pairs_each_question_full_against_compressed():
    samples = [
        sample("full", "a", 1000.0), sample("compressed", "a", 200.0, compression_ms=40.0),
        sample("full", "b", 2000.0), sample("compressed", "b", 400.0, compression_ms=400.0),
        sample("ideal", "b", 400.0),
    ]
    payback = compression_payback(samples)
    assert payback["questions"] == 2
    assert payback["prefill_ms_saved"]["mean"] == pytest.approx(1200.0)
    # shares 40/800 = 0.05 and 400/1600 = 0.25: the P95 sits near the worse one
    assert 0.2 < payback["compression_share_of_saving_p95"] <= 0.25


def test_acceptance_reads_the_cold_pass_and_leaves_missing_figures_undecided():
    summary = {"cold": {"gain": 3.5, "efficiency": 0.8, "gateway_vs_engine_req_s": 0.95,
                        "gateway_vs_engine_tpot_p50": None, "compressed_vs_ideal_ttft_p95": 1.05,
                        "payback": {"compression_share_of_saving_p95": 0.2}}}
    met = {check["check"]: check["met"] for check in acceptance(summary)}
    assert met["gain (compressed/full req/s) >= 3"] is True
    assert met["efficiency (compressed/ideal req/s) >= 0.9, cold"] is False
    assert met["gateway passthrough TPOT P50 <= 1.1x engine-alone"] is None
    assert met["first-sight compression <= 1/10 of prefill saved (P95)"] is False


@pytest.mark.slow
def test_bench_e2e_command_runs_every_arm_on_the_same_questions(tmp_path):
    out = tmp_path / "e2e"
    result = subprocess.run(
        [sys.executable, "-m", "ctxgate", "bench", "e2e", "--limit", "2", "--output-tokens", "4",
         "--concurrency", "1", "--no-warm-pass", "--no-progress", "--compression-workers", "2",
         "--max-num-batched-tokens", "256", "--out", str(out)],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "bench_e2e.json").read_text())
    assert report["compression_workers"] == 2  # handed to the gateway as `serve --compression-workers`
    assert report["max_num_batched_tokens"] == 256  # and the step budget to both engines
    arms = report["levels"]["1"]["summary"]["cold"]["arms"]
    assert {arm: arms[arm]["requests"] for arm in arms} == {"full": 2, "compressed": 2, "ideal": 2, "engine": 2}
    assert all(arms[arm]["errors"] == 0 for arm in arms)
    assert all(arms[arm]["output_tok_s"] > 0 for arm in arms)
    # ideal and engine send what the compressed arm sent (up to the tag's tokens); full sends more.
    assert abs(arms["ideal"]["prompt_tokens_mean"] - arms["compressed"]["prompt_tokens_mean"]) <= 8
    assert abs(arms["engine"]["prompt_tokens_mean"] - arms["ideal"]["prompt_tokens_mean"]) <= 8
    assert arms["full"]["prompt_tokens_mean"] > 2 * arms["compressed"]["prompt_tokens_mean"]
    assert arms["compressed"]["compression_ms"]["p50"] > 0
    assert "dedup" in arms["compressed"]["compression_stage_ms"]  # where the embedding happens
    assert arms["compressed"]["compression_wait_ms"]["p50"] >= 0  # reported by the gateway, apart from the stages
    # The engine's queue time, through the gateway (usage) and from the engine alone (its metrics).
    assert all(arms[arm]["queue_ms"]["p50"] >= 0 for arm in arms)
    markdown = (out / "bench_e2e.md").read_text()
    assert "CPU path: cpu path" in markdown and "Acceptance at concurrency 1" in markdown
    assert "2 compression worker(s)" in markdown and "engine step budget 256 tokens" in markdown
    assert "engine queue ms, from submission to the first step" in markdown
    assert (out / "bench_e2e.png").stat().st_size > 0
