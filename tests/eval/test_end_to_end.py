"""Acceptance: eval runs through the real gateway (served on a free port) and the real model, with
the real OpenAI SDK. Small inputs: 5 questions with 6 passages each, max_tokens 8, and a test policy
(`eval-tight`, conftest.py) whose budget really cuts them."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ctxgate.eval.datasets import resolve_dataset_path

REPO_ROOT = Path(__file__).resolve().parents[2]
PLOTS = ("quality_vs_compression.png", "ttft_distribution.png", "tokens_saved_by_stage.png")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> Path:
    """The first 5 NQ questions, each with its gold passage and 5 distractors (short prefills)."""
    lines = resolve_dataset_path("nq-multidoc-dev.jsonl").read_text().splitlines()[:5]
    path = tmp_path_factory.mktemp("data") / "nq-small.jsonl"
    with path.open("w") as handle:
        for line in lines:
            record = json.loads(line)
            gold = [p for p in record["passages"] if p["is_gold"]]
            record["passages"] = [p for p in record["passages"] if not p["is_gold"]][:5] + gold
            handle.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def gateway_url(eval_engine, eval_policy_dir):
    """The real gateway app on a free port (uvicorn in a thread): packaged policies plus eval-tight."""
    from ctxgate.eval.server import InProcessGateway

    with InProcessGateway(policy_dir=eval_policy_dir, engine=eval_engine) as url:
        yield url


def ctxgate(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ctxgate", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def two_policy_run(small_dataset, gateway_url, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    result = ctxgate(
        "eval",
        "run",
        "--input",
        str(small_dataset),
        "--policy",
        "passthrough",
        "--policy",
        "eval-tight",
        "--limit",
        "5",
        "--max-tokens",
        "8",
        "--concurrency",
        "2",
        "--url",
        gateway_url,
        "--out",
        str(out),
        "--no-progress",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_two_policy_run_writes_every_report_file_and_plot(two_policy_run):
    for name in ("report.md", "report.json", "results.jsonl", *PLOTS):
        assert (two_policy_run / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (two_policy_run / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and not [row["error"] for row in rows if row["error"]]
    report = json.loads((two_policy_run / "report.json").read_text())
    passthrough, rag = report["arms"]["passthrough"], report["arms"]["eval-tight"]
    assert passthrough["n"] == rag["n"] == 5
    # Passthrough sends everything: every gold answer is in its context, nothing is saved.
    assert passthrough["answer_retention"]["value"] == 1.0
    assert passthrough["prompt_tokens_mean"] == pytest.approx(passthrough["original_prompt_tokens_mean"])
    assert rag["prompt_tokens_mean"] < passthrough["prompt_tokens_mean"]
    assert rag["compression_ratio"] > 1
    for arm in (passthrough, rag):
        assert arm["ttft_ms"]["p95"] > 0 and arm["latency_ms"]["p99"] >= arm["ttft_ms"]["p50"]
        assert arm["prefill_ms"]["p50"] is not None
        assert 0 <= arm["accuracy"]["ci_low"] <= arm["accuracy"]["value"] <= arm["accuracy"]["ci_high"] <= 1
    for row in rows:
        assert row["completion_tokens"] <= 8
        assert any(row["question"] in str(message.get("content")) for message in row["sent_messages"])
    assert report["comparisons"][0]["candidate"] == "eval-tight"


def test_gate_passes_identical_and_fails_planted_drop(two_policy_run, tmp_path):
    report_path = two_policy_run / "report.json"
    same = ctxgate(
        "eval",
        "gate",
        "--baseline",
        str(report_path),
        "--current",
        str(report_path),
        "--max-accuracy-drop",
        "0.02",
        "--max-retention-drop",
        "0.02",
        timeout=120,
    )
    assert same.returncode == 0, same.stdout + same.stderr
    # Plant a drop: a copy of the real report in which passthrough lost the answer from every context.
    report = json.loads(report_path.read_text())
    degraded = copy.deepcopy(report)
    arm = degraded["arms"]["passthrough"]
    for scores in arm["per_question"].values():
        scores["answer_retention"] = 0.0
    arm["answer_retention"]["value"] = 0.0
    degraded_path = tmp_path / "degraded.json"
    degraded_path.write_text(json.dumps(degraded))
    regressed = ctxgate(
        "eval",
        "gate",
        "--baseline",
        str(report_path),
        "--current",
        str(degraded_path),
        "--max-accuracy-drop",
        "0.02",
        "--max-retention-drop",
        "0.02",
        timeout=120,
    )
    assert regressed.returncode == 1
    assert "FAIL passthrough: answer_retention dropped by +1.000" in regressed.stdout
    assert "95% CI of drop" in regressed.stdout


def test_sweep_produces_one_row_per_value(small_dataset, eval_engine, eval_policy_dir, tmp_path):
    """Without --url the runner serves a gateway itself, on a policy dir holding one derived policy
    per value (here in this process, sharing the loaded engine)."""
    from ctxgate.eval.runner import RunConfig, run_eval
    from ctxgate.eval.server import InProcessGateway
    from ctxgate.eval.sweep import parse_sweep

    served_policy_dirs = []

    def launcher(policy_dir, log_path):
        served_policy_dirs.append(policy_dir)
        return InProcessGateway(policy_dir=policy_dir, engine=eval_engine)

    out = tmp_path / "sweep"
    config = RunConfig(
        dataset=str(small_dataset),
        policies=["eval-tight"],
        out_dir=str(out),
        limit=2,
        max_tokens=4,
        sweep=parse_sweep("max_input_tokens=250,700"),
        policy_dir=str(eval_policy_dir),
        progress=False,
    )
    report = run_eval(config, launcher=launcher)
    assert served_policy_dirs and served_policy_dirs[0] is not None
    rows = report["sweep"]["rows"]
    assert [row["value"] for row in rows] == [250, 700]
    assert [row["policy"] for row in rows] == [
        "eval-tight--max_input_tokens-250",
        "eval-tight--max_input_tokens-700",
    ]
    assert rows[0]["prompt_tokens_mean"] < rows[1]["prompt_tokens_mean"]
    assert json.loads((out / "report.json").read_text())["sweep"]["rows"] == rows
    assert "Sweep of `max_input_tokens`" in (out / "report.md").read_text()
    for name in PLOTS:
        assert (out / name).exists()


def test_sweep_against_a_running_gateway_uses_request_overrides(small_dataset, gateway_url, tmp_path):
    result = ctxgate(
        "eval",
        "run",
        "--input",
        str(small_dataset),
        "--policy",
        "eval-tight",
        "--sweep",
        "max_input_tokens=250,700",
        "--limit",
        "2",
        "--max-tokens",
        "4",
        "--url",
        gateway_url,
        "--out",
        str(tmp_path),
        "--no-progress",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "report.json").read_text())["sweep"]["rows"]
    assert [row["value"] for row in rows] == [250, 700] and {row["policy"] for row in rows} == {"eval-tight"}
    assert rows[0]["prompt_tokens_mean"] < rows[1]["prompt_tokens_mean"]


def test_bench_prefill_fits_a_cost_model(small_dataset, gateway_url, tmp_path):
    result = ctxgate(
        "bench",
        "prefill",
        "--input",
        str(small_dataset),
        "--policy",
        "eval-tight",
        "--limit",
        "3",
        "--warmup",
        "1",
        "--url",
        gateway_url,
        "--out",
        str(tmp_path),
        "--no-progress",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    cost = json.loads((tmp_path / "prefill_cost.json").read_text())
    assert cost["schema"] == "ctxgate.prefill_cost/v1"
    assert cost["prefill_ms"]["n"] == 6 and cost["prefill_ms"]["ms_per_token"] > 0
    bench = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert bench["summary"]["tokens_removed_mean"] > 0
    assert bench["summary"]["prefill_ms_saved_mean"] > 0
    # The same questions were served by earlier tests on this gateway: still no prefix-cache hits.
    assert bench["summary"]["cached_prompt_tokens_full_mean"] == 0


def test_cli_without_url_starts_and_stops_ctxgate_serve(small_dataset, eval_policy_dir, tmp_path):
    """The default mode: `ctxgate eval run` launches `ctxgate serve` on a free port, then stops it."""
    result = ctxgate(
        "eval",
        "run",
        "--input",
        str(small_dataset),
        "--policy",
        "passthrough",
        "--policy",
        "eval-tight",
        "--policy-dir",
        str(eval_policy_dir),
        "--limit",
        "1",
        "--max-tokens",
        "4",
        "--out",
        str(tmp_path),
        "--no-progress",
    )
    assert result.returncode == 0, result.stdout + result.stderr + (tmp_path / "gateway.log").read_text()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["arms"]["eval-tight"]["n"] == 1 and report["arms"]["eval-tight"]["errors"] == 0
    assert (tmp_path / "gateway.log").exists()
    # A newcomer sees each step of the silent first seconds, on stderr (stdout keeps the results).
    steps = [
        f"reading the dataset {small_dataset}",
        "starting the gateway (ctxgate serve) on http://127.0.0.1:",
        f"its log: {tmp_path / 'gateway.log'}",
        "the gateway (ctxgate serve) ready at http://127.0.0.1:",
        "1 question x 2 arms = 2 requests",
        "gateway stopped",
        "2 requests in",
        f"writing the report and plots into {tmp_path}",
    ]
    positions = [result.stderr.find(step) for step in steps]
    assert -1 not in positions and positions == sorted(positions), result.stderr
    assert "reading the dataset" not in result.stdout


def test_compress_only_run_measures_retention_without_generating(small_dataset, gateway_url, tmp_path):
    result = ctxgate(
        "eval",
        "run",
        "--input",
        str(small_dataset),
        "--policy",
        "passthrough",
        "--policy",
        "eval-tight",
        "--compress-only",
        "--url",
        gateway_url,
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The progress bar (stderr) names the dataset; 5 questions x 2 arms.
    assert f"using the running gateway at {gateway_url}" in result.stderr
    assert "eval nq-small: 100%" in result.stderr and "10/10" in result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    passthrough, tight = report["arms"]["passthrough"], report["arms"]["eval-tight"]
    assert passthrough["answer_retention"]["value"] == 1.0 and passthrough["n"] == 5
    assert tight["prompt_tokens_mean"] < passthrough["prompt_tokens_mean"]
    assert tight["accuracy"]["value"] is None and tight["ttft_ms"]["p95"] is None
    assert "eval-tight: accuracy not measured" in result.stdout and "TTFT" not in result.stdout
    for name in PLOTS:
        assert (tmp_path / name).stat().st_size > 0
