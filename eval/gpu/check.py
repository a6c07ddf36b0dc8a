"""`ctxgate bench gpu`: the offline GPU check in one command, in stages.

    python -m ctxgate.eval.gpu.check --out DIR [--quick] [--shapes smollm2-135m,...] [--work DIR]

Each stage runs under its own time budget and is recorded (ok / failed / skipped, seconds, result)
in DIR/gpu_check.json and DIR/gpu_check.md as soon as it ends, so a later failure or the machine's
10-minute limit keeps what came before. Stages that need CUDA say "skipped: no CUDA" on a CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxgate.eval.gpu import random_model

ALL_SHAPES = random_model.SHAPES
# The workloads of issue 50 (in tokens): (concurrency, prompt, output, requests in full / quick mode).
WORKLOADS = {"W1": (1, 256, 128, 8, 4), "W2": (32, 512, 128, 64, 32), "W3": (8, 2000, 32, 32, 16)}
# Seconds per stage on an H100, in full / quick mode (about 8 / 3 minutes in all).
BUDGET_S = {
    "environment": (15, 10),
    "install": (10, 5),
    "build": (90, 40),
    "parity": (90, 35),
    "throughput": (180, 60),
    "e2e": (90, 30),
}


INSTALL_MODULES = (
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "pydantic_core",
    "gguf",
    "redis",
    "xgrammar",
    "bm25s",
    "sentencex",
    "ninja",
    "tiktoken",
    "transformers",
    "sentence_transformers",
    "safetensors",
    "ctxgate.gateway.app",
    "ctxgate.backend.engine.llm_engine",
)


class Skipped(Exception):
    """A stage that cannot run here (no CUDA); recorded as skipped, not failed."""


@dataclass
class Check:
    out: Path
    work: Path
    shapes: list[str]
    quick: bool
    cuda: bool
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    models: dict[str, Path] = field(default_factory=dict)

    def budget(self, stage: str) -> int:
        return BUDGET_S[stage][1 if self.quick else 0]

    def run(self, name: str, body: Callable[[], Any]) -> None:
        started = time.monotonic()
        try:
            entry = {"status": "ok", "result": body()}
        except Skipped as why:
            entry = {"status": "skipped", "reason": str(why)}
        except Exception as error:  # a failed stage is recorded; the next one still runs
            entry = {
                "status": "failed",
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc(limit=6),
            }
        entry["seconds"] = round(time.monotonic() - started, 1)
        entry["budget_s"] = self.budget(name)
        self.stages[name] = entry
        print(
            f"[gpu check] {name}: {entry['status']} in {entry['seconds']} s {entry.get('reason', entry.get('error', ''))}",
            flush=True,
        )
        self.write()

    def write(self) -> None:
        report = {
            "schema": "ctxgate.gpu_check/v1",
            "quick": self.quick,
            "shapes": self.shapes,
            "stages": self.stages,
        }
        (self.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
        (self.out / "gpu_check.md").write_text(render_markdown(report))


def environment(check: Check) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": check.cuda,
        "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=random_model.HERE
        ).stdout.strip()
        or None,
    }
    if check.cuda:
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": torch.cuda.get_device_name(),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "copy_bandwidth_gb_s": round(copy_bandwidth_gb_s(), 1),
        }
    return info


def copy_bandwidth_gb_s(size_mib: int = 1024, repeats: int = 10) -> float:
    """Device-to-device copy: each byte read once and written once."""
    import torch

    source = torch.empty(size_mib << 20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    torch.cuda.synchronize()
    return 2 * source.numel() * repeats / (time.perf_counter() - started) / 1e9


def install() -> dict[str, Any]:
    """Every runtime module the gateway and the engine import, from the carried wheels or the machine."""
    import importlib

    versions = {}
    for name in INSTALL_MODULES:
        module = importlib.import_module(name)
        versions[name] = getattr(module, "__version__", "")
    return versions


def build(check: Check) -> dict[str, Any]:
    built = {}
    for shape in check.shapes:
        started = time.monotonic()
        check.models[shape] = random_model.build_model(shape, check.work / "models" / shape)
        built[shape] = {
            "params_b": round(random_model.parameter_count(random_model.shape_config(shape)) / 1e9, 3),
            "seconds": round(time.monotonic() - started, 1),
        }
    check.models["embedder"] = random_model.build_embedder(check.work / "models" / "minilm-random")
    return built


def parity(check: Check) -> dict[str, Any]:
    from ctxgate.eval.gpu.parity import check_parity

    results, failed = {}, []
    # On a CPU the reference is exact in float32; bfloat16 (and the CUDA-graph path) is the GPU's.
    variants = (
        [("cuda", "bfloat16", False), ("cuda", "bfloat16", True)]
        if check.cuda
        else [("cpu", "float32", False)]
    )
    for shape in check.shapes:
        if not check.cuda and shape != "smollm2-135m":
            continue  # the larger shapes take minutes on a CPU; the GPU checks them all
        for device, dtype, graphs in variants:
            outcome = check_parity(check.models[shape], device, dtype, graphs).as_dict()
            results[f"{shape}/{dtype}{'/graphs' if graphs else ''}"] = outcome
            if not outcome["passed"]:
                failed.append(shape)
    if failed:
        raise AssertionError(f"greedy tokens differ from transformers at {sorted(set(failed))}: {results}")
    return results


def throughput(check: Check) -> dict[str, Any]:
    if not check.cuda:
        raise Skipped("no CUDA")
    from ctxgate.eval.gpu.roofline import run_workloads

    return run_workloads(check, WORKLOADS)


def e2e(check: Check) -> dict[str, Any]:
    if not check.cuda:
        raise Skipped("no CUDA")
    from ctxgate.eval.gpu.roofline import run_e2e

    return run_e2e(check)


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# GPU check{' (quick)' if report['quick'] else ''}",
        "",
        f"shapes: {', '.join(report['shapes'])}",
        "",
        "| stage | status | seconds | budget s | note |",
        "|---|---|---|---|---|",
    ]
    for name, entry in report["stages"].items():
        note = entry.get("reason") or entry.get("error") or ""
        lines.append(
            f"| {name} | {entry['status']} | {entry['seconds']} | {entry['budget_s']} | {note[:200]} |"
        )
    env = report["stages"].get("environment", {}).get("result") or {}
    if env:
        lines += ["", "environment: " + ", ".join(f"{k} {v}" for k, v in env.items())]
    for name in ("parity", "throughput", "e2e"):
        result = report["stages"].get(name, {}).get("result")
        if result:
            lines += [
                "",
                f"## {name}",
                "",
                "```json",
                json.dumps(result, indent=1, default=str)[:6000],
                "```",
            ]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="report folder (gpu_check.json, gpu_check.md)")
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "ctxgate-gpu-check",
        help="where the models are written (default: ctxgate-gpu-check in the system's temporary folder)",
    )
    parser.add_argument("--shapes", default=",".join(ALL_SHAPES), help="comma-separated shapes")
    parser.add_argument("--quick", action="store_true", help="about 3 minutes instead of 8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctxgate bench gpu", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_check(parser.parse_args(argv))


def run_check(args: argparse.Namespace) -> int:
    import torch

    shapes = [name.strip() for name in args.shapes.split(",") if name.strip()]
    unknown = sorted(set(shapes) - set(ALL_SHAPES))
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; choose from {', '.join(ALL_SHAPES)}")
    cuda = torch.cuda.is_available()
    if not cuda:  # 8B on a CPU: 16 GB of weights and hours of HF generate
        shapes = [shape for shape in shapes if shape != "llama-3.1-8b"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, Path(args.work), shapes, args.quick, cuda)
    check.run("environment", lambda: environment(check))
    check.run("install", install)
    check.run("build", lambda: build(check))
    check.run("parity", lambda: parity(check))
    check.run("throughput", lambda: throughput(check))
    check.run("e2e", lambda: e2e(check))
    failed = [name for name, entry in check.stages.items() if entry["status"] == "failed"]
    print(f"[gpu check] report: {out / 'gpu_check.md'}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
