"""`ctxgate bench ...` (and later `ctxgate eval ...`) commands."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="performance benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _register_bench_engine(bench_sub)


def _register_bench_engine(bench_sub: argparse._SubParsersAction) -> None:
    from backend.cli import add_engine_arguments  # argparse only: keeps `ctxgate --help` instant

    engine = bench_sub.add_parser(
        "engine",
        help="workloads W1-W3 against the engine (or --url server) and the HF generate baseline",
    )
    engine.add_argument("--url", default=None, help="benchmark this OpenAI-compatible server instead")
    engine.add_argument("--model-name", default=None, help="model id to request in --url mode")
    engine.add_argument(
        "--server-pid", type=int, action="append", default=[],
        help="in --url mode, the server's pid: its CPU time is not counted as a neighbour's",
    )
    engine.add_argument("--workloads", default="W1,W2,W3", help="comma-separated subset of W1,W2,W3")
    engine.add_argument("--num-requests", type=int, default=None, help="scale every workload to N requests")
    engine.add_argument("--prompt-tokens", type=int, default=None, help="override prompt length")
    engine.add_argument("--output-tokens", type=int, default=None, help="override output length")
    engine.add_argument("--concurrency", type=int, default=None, help="override concurrency")
    engine.add_argument("--repeats", type=int, default=1, help="A/B repetitions per workload (interleaved)")
    engine.add_argument("--no-baseline", action="store_true", help="skip the HF generate baseline")
    engine.add_argument(
        "--busy-threshold", type=float, default=0.10,
        help="repeat a run when other processes used more than this share of the machine's CPU",
    )
    engine.add_argument("--max-attempts", type=int, default=3, help="attempts per run with a busy neighbour")
    engine.add_argument("--seed", type=int, default=0, help="prompt generation seed")
    engine.add_argument("--out", default=None, help="directory for bench_engine.json")
    add_engine_arguments(engine)
    engine.set_defaults(func=_bench_engine)


def _bench_engine(args: argparse.Namespace) -> int:
    from eval.bench_engine_cli import bench_engine_command

    return bench_engine_command(args)
