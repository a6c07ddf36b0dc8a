"""Smoke tests of `ctxgate bench engine`: a tiny scaled-down workload, JSON report shape (not timing)."""

from __future__ import annotations

import json

from ctxgate.cli import main
from ctxgate.eval.bench_engine import WORKLOADS, make_prompt_messages, scaled_workload
from tests.support.servers import serve_engine

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
    code = main(
        [
            "bench",
            "engine",
            "--workloads",
            "W1",
            *TINY,
            "--out",
            str(out_dir),
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "32",
            "--max-model-len",
            "128",
        ]
    )
    assert code == 0
    report = json.loads((out_dir / "bench_engine.json").read_text())
    entry = report["workloads"]["W1"]
    assert entry["workload"]["num_requests"] == 2 and entry["workload"]["concurrency"] == 1
    _check_run_summary(entry["engine"])
    _check_run_summary(entry["hf_generate"])
    assert set(entry["ratios"]) >= {"output_tok_s", "req_s", "ttft_p50_speedup", "tpot_p50_speedup"}
    assert report["settings"]["baseline_dtype"] == "torch.float32"


def test_bench_engine_url_mode(tmp_path, model_dir):
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig

    engine = AsyncEngine(
        EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=32, max_model_len=128)
    )
    out_dir = tmp_path / "bench"
    with serve_engine(engine) as url:
        # The same server once more as a "peer": the interleaved side-by-side mode.
        code = main(
            [
                "bench",
                "engine",
                "--url",
                url,
                "--peer",
                f"again={url}",
                "--workloads",
                "W2",
                *TINY,
                "--no-baseline",
                "--out",
                str(out_dir),
                "--model",
                str(model_dir),
            ]
        )
    assert code == 0
    report = json.loads((out_dir / "bench_engine.json").read_text())
    entry = report["workloads"]["W2"]
    assert entry["workload"]["concurrency"] == 2
    _check_run_summary(entry["server"])
    _check_run_summary(entry["again"])
    assert set(entry["ratios_vs"]["again"]) >= {"output_tok_s", "ttft_p95_speedup", "tpot_p50_speedup"}
    assert report["settings"]["peers"] == {"again": url.rstrip("/")}
    assert "hf_generate" not in entry


def test_bench_engine_rejects_bad_peer_specs():
    import pytest

    from ctxgate.eval.bench_engine_cli import parse_peers

    assert parse_peers(["vllm=http://h:1", "llama=http://h:2"], "server") == [
        ("vllm", "http://h:1"),
        ("llama", "http://h:2"),
    ]
    for bad in (
        ["vllm"],
        ["=http://h:1"],
        ["x=ftp://h"],
        ["server=http://h:1"],
        ["a=http://h:1", "a=http://h:2"],
    ):
        with pytest.raises(ValueError):
            parse_peers(bad, "server")


def test_cpu_meter_counts_a_servers_children_as_its_own():
    import os
    import subprocess
    import sys

    from ctxgate.eval.bench_engine import CpuMeter

    already_own = CpuMeter()._own_pids()  # this test process's other descendants (test servers)
    grandchild = (
        "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"
    )
    parent = subprocess.Popen([sys.executable, "-c", grandchild])
    try:
        import time

        deadline = time.monotonic() + 10
        meter = CpuMeter([parent.pid])
        while time.monotonic() < deadline and len(meter._own_pids()) < 3:
            time.sleep(0.05)
        own = meter._own_pids()
        assert {os.getpid(), parent.pid} <= own and len(own) >= 3  # the grandchild is found too
    finally:
        for pid in CpuMeter([parent.pid])._own_pids() - already_own:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        parent.wait()


def test_prompts_differ_and_have_the_requested_length(tokenizer):
    workload = scaled_workload(WORKLOADS["W3"], num_requests=4, prompt_tokens=120)
    conversations = make_prompt_messages(tokenizer, workload, seed=1)
    lengths = [tokenizer.count_chat(messages) for messages in conversations]
    assert all(abs(length - 120) <= 4 for length in lengths), lengths
    first_tokens = {tuple(tokenizer.encode_chat(m)[:40]) for m in conversations}
    assert len(first_tokens) == 4
    assert make_prompt_messages(tokenizer, workload, seed=2) != conversations


def test_bench_engine_url_mode_with_api_key(tmp_path, model_dir, capsys):
    """`--api-key` reaches a gateway that has a keys file; without it the gateway's 401 is a clear error."""
    import yaml

    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.gateway.app import create_app
    from ctxgate.gateway.keys import hash_key
    from ctxgate.gateway.settings import GatewaySettings
    from tests.support.servers import ServerThread

    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"tenants": {"bench": {"keys": [{"sha256": hash_key("cg-bench-key")}]}}}))
    engine = AsyncEngine(
        EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=32, max_model_len=128)
    )
    settings = GatewaySettings(keys_file=keys, default_policy="passthrough", served_model_name="bench-model")
    args = ["bench", "engine", "--workloads", "W1", *TINY, "--no-baseline", "--model", str(model_dir)]
    try:
        with ServerThread(create_app(settings, engine=engine)) as gateway:
            refused = main([*args, "--url", gateway.url])
            assert refused == 2 and "no OpenAI-compatible server listed a model" in capsys.readouterr().err
            code = main(
                [*args, "--url", gateway.url, "--api-key", "cg-bench-key", "--out", str(tmp_path / "b")]
            )
    finally:
        engine.shutdown()
    assert code == 0
    report = json.loads((tmp_path / "b" / "bench_engine.json").read_text())
    _check_run_summary(report["workloads"]["W1"]["server"])
