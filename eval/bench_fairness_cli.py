"""`ctxgate bench fairness`'s flags (import-light: eval/bench_fairness.py runs it)."""

from __future__ import annotations

import argparse
import shlex
import sys

from ctxgate.backend.settings.cli_actions import at_least_one, positive_number
from ctxgate.eval.cli_common import quiet_http_logs

# A smoke run: one round of short segments, fewer calibration requests.
QUICK_FAIRNESS = {"segment_s": 20.0, "rounds": 1, "calibration_requests": 2}


def register_bench_fairness(bench_sub: argparse._SubParsersAction) -> None:
    fairness = bench_sub.add_parser(
        "fairness",
        help="noisy neighbour through the real gateway: tenant A floods the engine with long prompts, "
        "tenant B sends short ones; B's TTFT vs B alone and A's goodput, fair queuing on vs off, interleaved",
    )
    fairness.add_argument(
        "--segment-s",
        type=positive_number,
        default=60.0,
        help="seconds of load per arm and round (default 60)",
    )
    fairness.add_argument("--rounds", type=at_least_one, default=2, help="interleaved rounds (default 2)")
    fairness.add_argument(
        "--overload",
        type=positive_number,
        default=5.0,
        help="A's offered load as a multiple of the measured capacity (default 5)",
    )
    fairness.add_argument(
        "--noisy-rate",
        type=positive_number,
        default=None,
        help="A's requests/s (default: --overload x capacity)",
    )
    fairness.add_argument(
        "--noisy-prompt-tokens", type=at_least_one, default=2500, help="A's prompt length (default 2500)"
    )
    fairness.add_argument(
        "--quiet-rate", type=positive_number, default=0.2, help="B's requests/s, Poisson (default 0.2)"
    )
    fairness.add_argument(
        "--output-tokens", type=at_least_one, default=16, help="tokens per answer (default 16)"
    )
    fairness.add_argument(
        "--calibration-requests",
        type=at_least_one,
        default=3,
        help="A's requests sent one at a time to measure capacity (default 3)",
    )
    fairness.add_argument("--model", help="model directory for the gateways (default: the default model)")
    fairness.add_argument(
        "--max-num-batched-tokens",
        type=at_least_one,
        default=None,
        metavar="N",
        help="the engine's token budget per step (default: the engine's own)",
    )
    fairness.add_argument("--seed", type=int, default=0, help="B's arrival schedule seed (default 0)")
    fairness.add_argument(
        "--quick", action="store_true", help="a smoke run: one round of 20 s segments, 2 calibration requests"
    )
    fairness.add_argument(
        "--out", default="bench-out/fairness", help="output directory (default bench-out/fairness)"
    )
    fairness.add_argument("--no-progress", action="store_true", help="no per-segment progress lines")
    fairness.set_defaults(func=_bench_fairness)


def _bench_fairness(args: argparse.Namespace) -> int:
    quiet_http_logs()
    from ctxgate.eval.bench_fairness import FairnessOptions, run_bench_fairness
    from ctxgate.eval.fairness_report import render_markdown

    options = FairnessOptions(
        segment_s=args.segment_s,
        rounds=args.rounds,
        overload=args.overload,
        noisy_rate=args.noisy_rate,
        noisy_prompt_tokens=args.noisy_prompt_tokens,
        quiet_rate=args.quiet_rate,
        output_tokens=args.output_tokens,
        calibration_requests=args.calibration_requests,
        model=args.model,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        progress=not args.no_progress,
    )
    if args.quick:
        for name, value in QUICK_FAIRNESS.items():
            setattr(options, name, value)
    report = run_bench_fairness(options, args.out, command="ctxgate " + shlex.join(sys.argv[1:]))
    print(render_markdown(report))
    print(f"report: {args.out}/bench_fairness.md")
    return 0
