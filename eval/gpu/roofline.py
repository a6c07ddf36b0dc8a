"""The GPU check's CUDA stages: W1-W3 against HF static-batch `generate` and the roofline, and the
gateway end to end at the 8B shape (full vs compressed vs ideal). Both run the project's own
benchmarks (`ctxgate bench engine`, `ctxgate bench e2e`) in child processes with a timeout each, so
a hang costs its stage, not the check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxgate.eval.gpu import random_model

if TYPE_CHECKING:
    from ctxgate.eval.gpu.check import Check

E2E_SHAPE = "llama-3.1-8b"


def decode_step_bytes(config: dict, batch: int, context: int) -> int:
    """Bytes one decode step must read at least: every weight once, and each sequence's KV so far."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_per_token = config["num_hidden_layers"] * 2 * kv_heads * head_dim * 2
    return random_model.parameter_count(config) * 2 + batch * context * kv_per_token


def roofline_tpot_ms(config: dict, batch: int, prompt: int, output: int, bandwidth_gb_s: float) -> float:
    context = prompt + output // 2  # the mean context over the decode
    return decode_step_bytes(config, batch, context) / (bandwidth_gb_s * 1e9) * 1e3


def _child(args: list[str], timeout_s: float) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(random_model.HERE.parents[1]), os.environ.get("PYTHONPATH")])
        ),
    }
    subprocess.run([sys.executable, "-m", "ctxgate.cli", *args], check=True, timeout=timeout_s, env=env)


def run_workloads(check: Check, workloads: dict[str, tuple[int, int, int, int, int]]) -> dict[str, Any]:
    bandwidth = check.stages["environment"]["result"]["copy_bandwidth_gb_s"]
    shapes = [E2E_SHAPE] if E2E_SHAPE in check.shapes else check.shapes[-1:]
    names = ["W1", "W2"] if check.quick else list(workloads)
    per_run = check.budget("throughput") / max(1, len(shapes) * len(names))
    results: dict[str, Any] = {}
    for shape in shapes:
        config = random_model.shape_config(shape)
        for name in names:
            concurrency, prompt, output, full_n, quick_n = workloads[name]
            with tempfile.TemporaryDirectory() as scratch:
                _child(
                    [
                        "bench",
                        "engine",
                        "--model",
                        str(check.models[shape]),
                        "--device",
                        "cuda",
                        "--dtype",
                        "bfloat16",
                        "--workloads",
                        name,
                        "--num-requests",
                        str(quick_n if check.quick else full_n),
                        "--prompt-tokens",
                        str(prompt),
                        "--output-tokens",
                        str(output),
                        "--concurrency",
                        str(concurrency),
                        "--repeats",
                        "1",
                        "--no-progress",
                        "--out",
                        scratch,
                    ],
                    per_run,
                )
                report = json.loads((Path(scratch) / "bench_engine.json").read_text())
            entry = report["workloads"][name]
            roof = roofline_tpot_ms(config, concurrency, prompt, output, bandwidth)
            tpot = entry["engine"]["tpot_ms"]["p50"]
            results[f"{shape}/{name}"] = {
                "engine": entry["engine"],
                "hf_generate": entry.get("hf_generate"),
                "ratios": entry.get("ratios"),
                "roofline_tpot_ms": round(roof, 3),
                "tpot_over_roofline": round(tpot / roof, 2),
            }
    return results


def run_e2e(check: Check) -> dict[str, Any]:
    if E2E_SHAPE not in check.shapes:
        raise RuntimeError(f"the end-to-end stage runs at the {E2E_SHAPE} shape, not among {check.shapes}")
    os.environ["CTXGATE_EMBED_MODEL"] = str(check.models["embedder"])
    limit = 8 if check.quick else 16
    with tempfile.TemporaryDirectory() as scratch:
        _child(
            [
                "bench",
                "e2e",
                "--model",
                str(check.models[E2E_SHAPE]),
                "--input",
                str(random_model.HERE / "nq-dev-sample.jsonl"),
                "--limit",
                str(limit),
                "--concurrency",
                "4",
                "--no-warm-pass",
                "--engine-server",
                "--no-progress",
                "--out",
                scratch,
            ],
            check.budget("e2e"),
        )
        report = json.loads((Path(scratch) / "bench_e2e.json").read_text())
    return {
        level: data["summary"] | {"acceptance": data["acceptance"]}
        for level, data in report["levels"].items()
    }
