"""Smoke tests of `ctxgate bench engine`: a tiny scaled-down workload, JSON report shape (not timing)."""

from __future__ import annotations

import json

from ctxgate.cli import main
from eval.bench_engine import WORKLOADS, make_prompt_messages, percentile, scaled_workload
from tests.backend.engine_server import running_server

TINY = ["--num-requests", "2", "--prompt-tokens", "40", "--output-tokens", "3", "--max-attempts", "1"]


def _check_run_summary(summary: dict) -> None:
    assert summary["output_tok_s"] > 0 and summary["req_s"] > 0
    for key in ("ttft_ms", "tpot_ms"):
        assert set(summary[key]) >= {"p50", "p95", "p99"}
        assert summary[key]["p50"] > 0
    run = summary["runs"][0]
    assert run["num_requests"] == 2 and run["output_tokens_total"] == 6
    assert {"others_cpu_s", "others_cpu_frac", "own_cpu_s", "wall_s"} <= set(run["cpu"])


def test_bench_engine_in_process_with_baseline(tmp_path, model_dir):
    out_dir = tmp_path / "bench"
    code = main([
        "bench", "engine", "--workloads", "W1", *TINY, "--out", str(out_dir), "--model", str(model_dir),
        "--dtype", "float32", "--num-kv-blocks", "32", "--max-model-len", "128",
    ])
    assert code == 0
    report = json.loads((out_dir / "bench_engine.json").read_text())
    entry = report["workloads"]["W1"]
    assert entry["workload"]["num_requests"] == 2 and entry["workload"]["concurrency"] == 1
    _check_run_summary(entry["engine"])
    _check_run_summary(entry["hf_generate"])
    assert set(entry["ratios"]) >= {"output_tok_s", "req_s", "ttft_p50_speedup", "tpot_p50_speedup"}
    assert report["settings"]["baseline_dtype"] == "torch.float32"


def test_bench_engine_url_mode(tmp_path, model_dir):
    from backend.async_engine import AsyncEngine
    from backend.config import EngineConfig

    engine = AsyncEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=32, max_model_len=128))
    out_dir = tmp_path / "bench"
    with running_server(engine) as url:
        code = main(["bench", "engine", "--url", url, "--workloads", "W2", *TINY, "--no-baseline",
                     "--out", str(out_dir), "--model", str(model_dir)])
    assert code == 0
    entry = json.loads((out_dir / "bench_engine.json").read_text())["workloads"]["W2"]
    assert entry["workload"]["concurrency"] == 2
    _check_run_summary(entry["server"])
    assert "hf_generate" not in entry


def test_prompts_differ_and_have_the_requested_length(tokenizer):
    workload = scaled_workload(WORKLOADS["W3"], num_requests=4, prompt_tokens=120)
    conversations = make_prompt_messages(tokenizer, workload, seed=1)
    lengths = [tokenizer.count_chat(messages) for messages in conversations]
    assert all(abs(length - 120) <= 4 for length in lengths), lengths
    first_tokens = {tuple(tokenizer.encode_chat(m)[:40]) for m in conversations}
    assert len(first_tokens) == 4
    assert make_prompt_messages(tokenizer, workload, seed=2) != conversations


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile(list(range(101)), 95) == 95
