"""A/B of the engine's CPU paths in one process: float32 (what `--dtype auto` chose on CPUs without
AVX-512 BF16 before the AVX2 kernels) against the path `--dtype auto` chooses now, interleaved.

    python -m eval.cpu_paths_ab [--isa avx2|portable] [--threads 1] [--rounds 3] [--out DIR]

`--isa` caps the CPU path (ours through CTXGATE_CPU_ISA, torch's through ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS) by re-running this module in a child process, so an
AVX-512 machine measures what an AVX2-only CPU would run. Figures: median decode step at batch 1
(W1-like, 256-token prompts) and batch 16 (W2-like), and the prefill time of a 1500-token prompt
(W3-like), per round; the JSON names the CPU path of each arm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.cpu_paths_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", choices=["native", "avx2", "portable"], default="native",
                        help="cap the CPU path to this ISA (default: the machine's own)")
    parser.add_argument("--threads", type=int, default=1, help="engine threads per arm (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--out", default=None, help="write cpu_paths_ab.json into this folder")
    return parser.parse_args(argv)


def _run_requests(engine, batch: int, prompt_len: int, out_tokens: int, tag: str) -> tuple[float, float]:
    """(prefill seconds, median decode step seconds) for `batch` random prompts run together."""
    import torch

    from backend.api import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    for index in range(batch):
        prompt = torch.randint(100, 40000, (prompt_len,)).tolist()
        engine.add_request(GenerationRequest(f"{tag}-{index}", prompt, params))
    decode_steps: list[float] = []
    prefill_s = 0.0
    while engine.has_unfinished_requests():
        prefilled = all(seq.num_computed_tokens >= seq.num_prompt_tokens for seq in engine.sequences.values())
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if prefilled:
            decode_steps.append(elapsed)
        else:
            prefill_s += elapsed
    steady = decode_steps[2:] if len(decode_steps) > 4 else decode_steps
    return prefill_s, statistics.median(steady) if steady else float("nan")


def measure(threads: int, rounds: int) -> dict:
    import torch

    from backend.config import EngineConfig
    from backend.cpu_features import cpu_path
    from backend.llm_engine import LLMEngine

    engines = {
        name: LLMEngine(EngineConfig(dtype=dtype, num_threads=threads, kv_cache_memory_mb=256))
        for name, dtype in (("float32", "float32"), ("auto", "auto"))
    }
    torch.manual_seed(0)
    figures: dict[str, dict[str, list[float]]] = {
        name: {"decode_step_ms_batch1": [], "decode_step_ms_batch16": [], "prefill_1500_s": []} for name in engines
    }
    for round_index in range(rounds):
        for name, engine in engines.items():  # A B A B ...: both arms see the same drift
            _, batch1 = _run_requests(engine, 1, 256, 24, f"w1-{round_index}")
            _, batch16 = _run_requests(engine, 16, 128, 24, f"w2-{round_index}")
            prefill, _ = _run_requests(engine, 1, 1500, 2, f"w3-{round_index}")
            figures[name]["decode_step_ms_batch1"].append(batch1 * 1e3)
            figures[name]["decode_step_ms_batch16"].append(batch16 * 1e3)
            figures[name]["prefill_1500_s"].append(prefill)
            print(f"round {round_index} {name}: batch-1 step {batch1 * 1e3:.1f} ms, batch-16 step "
                  f"{batch16 * 1e3:.1f} ms, 1500-token prefill {prefill:.2f} s", flush=True)
    medians = {name: {key: statistics.median(values) for key, values in arm.items()} for name, arm in figures.items()}
    speedups = {key: medians["float32"][key] / medians["auto"][key] for key in medians["auto"]}
    return {
        "cpu_path": cpu_path().as_dict(),
        "threads": threads,
        "rounds": rounds,
        "arms": {name: engine.path_info() for name, engine in engines.items()},
        "figures": figures,
        "medians": medians,
        "auto_speedup_over_float32": speedups,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.isa != "native" and os.environ.get("CTXGATE_CPU_ISA") != args.isa:
        from backend.cpu_features import ISA_CAP_ENV, TORCH_ISA_CAPS

        env = {**os.environ, ISA_CAP_ENV: args.isa, **TORCH_ISA_CAPS[args.isa]}
        return subprocess.call([sys.executable, "-m", "eval.cpu_paths_ab", *(argv or sys.argv[1:])], env=env)
    result = measure(args.threads, args.rounds)
    print(json.dumps({"medians": result["medians"], "auto_speedup_over_float32": result["auto_speedup_over_float32"]},
                     indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cpu_paths_ab.json").write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
