"""Why the gateway keeps Python work away from the engine thread: decode-step time with and without
one busy Python thread in the same process, at CPython's default GIL switch interval and at the
engine's (backend/async_engine.py), and with the busy thread at a lower CPU priority (the compression
workers', GatewaySettings.compression_nice), each arm in a fresh child process.

    python -m eval.gil_ab [--rounds 3] [--arms TEXT] [--out DIR]

The busy thread splits sentences in a loop (the pure-Python part of compression). An eager forward
pass re-takes the GIL between every op, and each re-take can wait a whole switch interval while the
other thread runs bytecode; a traced decode step (the default on CPUs with the C++ kernels,
backend/decode_graphs.py) is one call. The "eager decode" arms show the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ARMS = {
    "alone, 5 ms switch interval": {"busy": False, "switch_s": 0.005},
    "beside a Python thread, 5 ms": {"busy": True, "switch_s": 0.005},
    "beside a Python thread, 0.5 ms": {"busy": True, "switch_s": 0.0005},
    "beside a Python thread, 0.1 ms": {"busy": True, "switch_s": 0.0001},
    "beside a Python thread, 0.05 ms": {"busy": True, "switch_s": 0.00005},
    # One OpenMP thread: the busy thread gets a core of its own, so what remains is the GIL alone.
    "alone, 0.5 ms, 1 OpenMP thread": {"busy": False, "switch_s": 0.0005, "engine_threads": 1},
    "beside a Python thread, 0.5 ms, 1 OpenMP thread": {"busy": True, "switch_s": 0.0005, "engine_threads": 1},
    # The engine's decode steps as eager Python op calls instead of traced functions (--no-cpu-decode-graphs).
    "alone, 0.5 ms, eager decode": {"busy": False, "switch_s": 0.0005, "traced": False},
    "beside a Python thread, 0.5 ms, eager decode": {"busy": True, "switch_s": 0.0005, "traced": False},
    # The busy thread at a lower CPU priority (the compression workers', GatewaySettings.compression_nice).
    "beside a Python thread, 0.5 ms, busy thread at nice 5": {"busy": True, "switch_s": 0.0005, "busy_nice": 5},
    "beside a Python thread, 0.5 ms, busy thread at nice 10": {"busy": True, "switch_s": 0.0005, "busy_nice": 10},
    "beside a Python thread, 0.5 ms, busy thread at nice 19": {"busy": True, "switch_s": 0.0005, "busy_nice": 19},
}


def _busy_python(stop: threading.Event, done: list[int], nice: int = 0) -> None:
    """Splits sentences until stopped; `done[0]` counts the splits (the busy thread's own progress).
    `nice`: the thread first lowers its CPU priority by that much, as a compression worker does."""
    from compression.pipeline import lower_thread_priority
    from compression.text import default_splitter

    lower_thread_priority(nice)
    splitter = default_splitter()
    text = "Dr. Smith went to Washington. He arrived on Jan. 5th at 3 p.m. and met Mr. Jones. " * 20
    while not stop.is_set():
        splitter.split(f"{text}{done[0]}")
        done[0] += 1


def measure_arm(
    busy: bool, switch_s: float, rounds: int, engine_threads: int | None = None, traced: bool = True,
    busy_nice: int = 0,
) -> dict[str, object]:
    """Median decode step (ms) at batch 1 and batch 4 and the median prefill of 4 x 512 tokens (ms)
    in this process, and the busy thread's splits per second meanwhile (how much the compressing side
    still gets done). The engine steps in this (main) thread with its configured OpenMP threads, or
    `engine_threads`; the busy thread runs no torch op, so it starts no OpenMP team of its own."""
    from backend import openmp
    from backend.config import EngineConfig
    from backend.llm_engine import LLMEngine
    from eval.cpu_paths_ab import _run_requests

    engine = LLMEngine(EngineConfig(dtype="auto", kv_cache_memory_mb=256, cpu_decode_graphs=None if traced else False))
    _run_requests(engine, 1, 64, 4, "warm-up")
    if engine_threads is not None:
        # After the warm-up: the engine's first step re-applies its own count (read back: 1, then 2).
        openmp.limit_calling_thread(engine_threads)
    sys.setswitchinterval(switch_s)
    stop = threading.Event()
    done = [0]
    thread = threading.Thread(target=_busy_python, args=(stop, done, busy_nice), daemon=True)
    started = time.perf_counter()
    if busy:
        thread.start()
    batch1, batch4, prefill = [], [], []
    for round_index in range(rounds):
        batch1.append(_run_requests(engine, 1, 256, 24, f"b1-{round_index}")[1] * 1e3)
        batch4.append(_run_requests(engine, 4, 128, 24, f"b4-{round_index}")[1] * 1e3)
        prefill.append(_run_requests(engine, 4, 512, 1, f"p4-{round_index}")[0] * 1e3)
    stop.set()
    if busy:
        thread.join()
    import torch

    return {"decode_step_ms_batch1": statistics.median(batch1), "decode_step_ms_batch4": statistics.median(batch4),
            "prefill_ms_4x512": round(statistics.median(prefill), 1),
            "busy_splits_per_s": round(done[0] / (time.perf_counter() - started), 1),
            "engine_openmp_threads": torch.get_num_threads(),
            "traced_decode_batch_sizes": engine.path_info().get("traced_decode_batch_sizes", [])}


def select_arms(text: str | None) -> list[str]:
    """The arms whose names contain `text` (all when None), always with the first: the baseline."""
    return [name for index, name in enumerate(ARMS) if index == 0 or text is None or text in name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.gil_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write gil_ab.json into this folder")
    parser.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # a child runs one arm
    parser.add_argument("--arms", default=None, help="only the arms whose names contain this text, and the first")
    args = parser.parse_args(argv)
    if args.arm is not None:
        print(json.dumps(measure_arm(**ARMS[args.arm], rounds=args.rounds)))
        return 0
    from eval.report import cpu_path_line

    results: dict[str, dict[str, object]] = {}
    for name in select_arms(args.arms):
        started = time.perf_counter()
        child = subprocess.run([sys.executable, "-m", "eval.gil_ab", "--arm", name, "--rounds", str(args.rounds)],
                               capture_output=True, text=True, check=True, env=os.environ.copy())
        results[name] = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"{name}: {results[name]} ({time.perf_counter() - started:.0f} s)", flush=True)
    report = {"cpu_path": cpu_path_line(), "rounds": args.rounds, "arms": results}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gil_ab.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
