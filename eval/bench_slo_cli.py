"""`ctxgate bench slo`: its flags and the function that runs it (eval/bench_slo.py does the work)."""

from __future__ import annotations

import argparse
import shlex
import sys

from ctxgate.backend.settings.cli_actions import (
    at_least_one,
    positive_number,
)
from ctxgate.eval.cli_common import quiet_http_logs, rates_argument, require_eval_extra

QUICK_SLO = {"requests": 3, "rates": [0.5, 2.0], "output_tokens": 4, "chunk_size": 3}


def register_bench_slo(bench_sub: argparse._SubParsersAction) -> None:
    slo = bench_sub.add_parser(
        "slo",
        help="goodput under a TTFT objective at several open-loop arrival rates: passthrough, fixed "
        "policies and the adaptive one, interleaved on the same held-out questions",
    )
    slo.add_argument(
        "--input",
        dest="dataset",
        default="nq-multidoc-dev.jsonl",
        help="QA JSONL (default nq-multidoc-dev.jsonl)",
    )
    slo.add_argument(
        "--split",
        choices=["test", "tune", "all"],
        default="test",
        help="which half of the questions (eval/splits.py; default test: held out from tuning)",
    )
    slo.add_argument(
        "--requests",
        type=at_least_one,
        default=24,
        help="questions, so requests per arm and rate (default 24)",
    )
    slo.add_argument(
        "--rates",
        type=rates_argument,
        default=[0.3, 0.6, 1.0],
        metavar="R,R,...",
        help="arrival rates in requests/s, below, at and above the knee (default 0.3,0.6,1.0)",
    )
    slo.add_argument(
        "--knee",
        type=positive_number,
        default=0.6,
        metavar="R",
        help="the rate taken as the knee: the retention bar applies below it, the 1.3x goodput "
        "bar above it (default 0.6)",
    )
    slo.add_argument(
        "--policy",
        action="append",
        dest="policies",
        default=None,
        help="a fixed policy arm (repeat; default rag-default and rag-fast)",
    )
    slo.add_argument(
        "--adaptive-policy", default="rag-adaptive", help="the adaptive arm (default rag-adaptive)"
    )
    slo.add_argument(
        "--slo-s",
        type=positive_number,
        default=None,
        metavar="S",
        help="the TTFT objective in seconds (default: the adaptive policy's ttft_slo_s)",
    )
    slo.add_argument(
        "--give-up-s",
        type=positive_number,
        default=None,
        metavar="S",
        help="abandon a request without a first token after S seconds (a miss; default 4 x the objective)",
    )
    slo.add_argument("--output-tokens", type=at_least_one, default=16, help="tokens per answer (default 16)")
    slo.add_argument(
        "--chunk-size", type=at_least_one, default=8, help="requests per interleaved chunk (default 8)"
    )
    slo.add_argument("--seed", type=int, default=0, help="arrival schedule seed (default 0)")
    slo.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 3 requests per arm at 0.5 and 2 requests/s, 4 output tokens",
    )
    slo.add_argument("--model", help="model directory for the gateway (default: the default model)")
    slo.add_argument("--policy-dir", help="extra policy directory for the gateway")
    slo.add_argument(
        "--max-num-batched-tokens",
        type=at_least_one,
        default=None,
        metavar="N",
        help="the engine's token budget per step (default: the engine's own)",
    )
    slo.add_argument("--out", default="bench-out/slo", help="output directory (default bench-out/slo)")
    slo.add_argument("--no-progress", action="store_true", help="no per-chunk progress lines")
    slo.set_defaults(func=_bench_slo)


def _bench_slo(args: argparse.Namespace) -> int:
    require_eval_extra("bench slo", "matplotlib", "pysbd")
    quiet_http_logs()
    from ctxgate.backend.platform.cpu_features import cpu_path
    from ctxgate.eval.bench_slo import SloOptions, run_bench_slo
    from ctxgate.eval.slo_report import render_markdown

    options = SloOptions(
        dataset=args.dataset,
        split=args.split,
        requests=args.requests,
        rates=args.rates,
        policies=args.policies or ["rag-default", "rag-fast"],
        adaptive=args.adaptive_policy,
        slo_s=args.slo_s,
        knee=args.knee,
        output_tokens=args.output_tokens,
        chunk_size=args.chunk_size,
        model=args.model,
        policy_dir=args.policy_dir,
        max_num_batched_tokens=args.max_num_batched_tokens,
        progress=not args.no_progress,
        seed=args.seed,
        give_up_s=args.give_up_s,
    )
    if args.quick:
        for name, value in QUICK_SLO.items():
            setattr(options, name, value)
    print(f"bench slo: {cpu_path().summary()}")
    report = run_bench_slo(options, args.out, command="ctxgate " + shlex.join(sys.argv[1:]))
    print(render_markdown(report))
    print(f"report: {args.out}/bench_slo.md")
    return 0
