"""The shadow commands: `ctxgate eval shadow-replay` (a shadow log scored again),
`ctxgate eval shadow-agreement` (live agreement beside offline retention on a QA dataset) and
`ctxgate bench shadow` (what shadowing costs live requests at the knee). Import-light: the work
happens in the modules each command imports when it runs."""

from __future__ import annotations

import argparse
import shlex
import sys

from ctxgate.backend.settings.cli_actions import at_least_one, positive_number
from ctxgate.eval.cli_common import quiet_http_logs, rates_argument, require_eval_extra

COMPARISONS = ["auto", "exact", "token_f1", "key_spans", "json_fields"]


def _command_line() -> str:
    return "ctxgate " + shlex.join(sys.argv[1:])


def register_eval_shadow(eval_sub: argparse._SubParsersAction) -> None:
    shadow = eval_sub.add_parser(
        "shadow-replay", help="score a gateway shadow log (server.shadow_log) again, or a candidate's answers"
    )
    shadow.add_argument("log", help="the shadow log: JSON lines written by the gateway")
    shadow.add_argument(
        "--comparison",
        choices=COMPARISONS,
        default="auto",
        help="the agreement measure (default auto: json_fields for JSON answers, else token_f1)",
    )
    shadow.add_argument(
        "--candidate",
        help="JSON lines of request_id and answer: a candidate policy's answers to the same requests, "
        "compared with the logged shadow answers",
    )
    shadow.add_argument("--sample", type=at_least_one, help="replay this many lines, drawn at random")
    shadow.add_argument("--seed", type=int, default=0, help="the draw's seed (default 0)")
    shadow.add_argument("--out", help="also write the report as JSON here")
    shadow.set_defaults(func=_eval_shadow_replay)

    agreement = eval_sub.add_parser(
        "shadow-agreement",
        help="live shadow agreement (sample_rate 1, idle gateway) on a QA dataset, beside the offline "
        "answer retention of the same questions",
    )
    agreement.add_argument(
        "--input",
        dest="dataset",
        default="nq-multidoc-dev.jsonl",
        help="QA JSONL (default nq-multidoc-dev.jsonl; a bare name is looked up in ../shared/data/eval)",
    )
    agreement.add_argument(
        "--policy", default="rag-default", help="the policy shadowed (default rag-default)"
    )
    agreement.add_argument(
        "--split",
        choices=["all", "tune", "test"],
        default="all",
        help="which questions (default all: the file's first N, as `ctxgate eval retention --limit N`)",
    )
    agreement.add_argument("--limit", type=at_least_one, default=50, help="questions (default 50)")
    agreement.add_argument(
        "--max-tokens", type=at_least_one, default=32, help="answer length cap (default 32)"
    )
    agreement.add_argument(
        "--comparison",
        choices=COMPARISONS,
        default="auto",
        help="the shadow section's agreement measure (default auto: token_f1 for text answers)",
    )
    agreement.add_argument(
        "--shadow-timeout-s",
        type=positive_number,
        default=600.0,
        metavar="S",
        help="the shadow section's timeout_s (default 600: a whole prompt on a busy CPU is slow)",
    )
    agreement.add_argument("--model", help="model directory for the gateway (default: the default model)")
    agreement.add_argument(
        "--policy-dir", help="the operator's policy directory (the policy is read from it first)"
    )
    agreement.add_argument(
        "--out",
        default="eval-out/shadow-agreement",
        help="output directory (default eval-out/shadow-agreement)",
    )
    agreement.add_argument("--no-progress", action="store_true", help="no line per question")
    agreement.set_defaults(func=_eval_shadow_agreement)


def _eval_shadow_replay(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ctxgate.eval.shadow_replay import describe, read_candidate, read_log, replay

    with open(args.log, encoding="utf-8") as handle:
        entries, skipped = read_log(handle)
    candidate = read_candidate(Path(args.candidate)) if args.candidate else None
    report = replay(entries, args.comparison, candidate, args.sample, args.seed, skipped)
    print(describe(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 0


def _eval_shadow_agreement(args: argparse.Namespace) -> int:
    require_eval_extra("eval shadow-agreement", "pysbd")
    quiet_http_logs()
    from ctxgate.eval.shadow_agreement import AgreementOptions, run_shadow_agreement
    from ctxgate.eval.shadow_agreement_report import render_markdown

    options = AgreementOptions(
        dataset=args.dataset,
        split=args.split,
        limit=args.limit,
        policy=args.policy,
        max_tokens=args.max_tokens,
        shadow_timeout_s=args.shadow_timeout_s,
        model=args.model,
        policy_dir=args.policy_dir,
        progress=not args.no_progress,
        shadow={"comparison": args.comparison},
    )
    report = run_shadow_agreement(options, args.out, command=_command_line())
    print(render_markdown(report))
    print(f"report: {args.out}/shadow_agreement.md")
    return 0


def register_bench_shadow(bench_sub: argparse._SubParsersAction) -> None:
    bench = bench_sub.add_parser(
        "shadow",
        help="what shadowing costs live requests at the knee: a policy with shadow sample_rate 0.2 "
        "against the same policy without, interleaved on the same open-loop schedules",
    )
    bench.add_argument(
        "--input",
        dest="dataset",
        default="nq-multidoc-dev.jsonl",
        help="QA JSONL (default nq-multidoc-dev.jsonl)",
    )
    bench.add_argument(
        "--split",
        choices=["test", "tune", "all"],
        default="test",
        help="which half of the questions (default test)",
    )
    bench.add_argument(
        "--requests",
        type=at_least_one,
        default=48,
        help="questions, so requests per arm and rate (default 48)",
    )
    bench.add_argument(
        "--rates",
        type=rates_argument,
        default=[0.6],
        metavar="R,R,...",
        help="arrival rates in requests/s (default 0.6: `ctxgate bench slo`'s knee)",
    )
    bench.add_argument(
        "--policy", default="rag-default", help="the policy of both arms (default rag-default)"
    )
    bench.add_argument(
        "--sample-rate",
        type=_share,
        default=0.2,
        metavar="F",
        help="the shadowed arm's shadow.sample_rate (default 0.2)",
    )
    bench.add_argument(
        "--adaptive-policy",
        default="rag-adaptive",
        help="the policy whose ttft_slo_s is the objective (default rag-adaptive)",
    )
    bench.add_argument(
        "--slo-s", type=positive_number, default=None, metavar="S", help="the TTFT objective in seconds"
    )
    bench.add_argument(
        "--give-up-s",
        type=positive_number,
        default=None,
        metavar="S",
        help="abandon a request without a first token after S s",
    )
    bench.add_argument(
        "--output-tokens", type=at_least_one, default=16, help="tokens per answer (default 16)"
    )
    bench.add_argument(
        "--chunk-size", type=at_least_one, default=8, help="requests per interleaved chunk (default 8)"
    )
    bench.add_argument("--seed", type=int, default=0, help="arrival schedule seed (default 0)")
    bench.add_argument("--model", help="model directory for the gateway (default: the default model)")
    bench.add_argument(
        "--policy-dir", help="the operator's policy directory (the policy is read from it first)"
    )
    bench.add_argument(
        "--out", default="bench-out/shadow", help="output directory (default bench-out/shadow)"
    )
    bench.add_argument("--no-progress", action="store_true", help="no per-chunk progress lines")
    bench.set_defaults(func=_bench_shadow)


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number above 0 and at most 1, got {text!r}")
    return value


def _bench_shadow(args: argparse.Namespace) -> int:
    require_eval_extra("bench shadow", "pysbd")
    quiet_http_logs()
    from ctxgate.eval.bench_shadow import ShadowBenchOptions, run_bench_shadow
    from ctxgate.eval.shadow_cost_report import render_markdown

    options = ShadowBenchOptions(
        dataset=args.dataset,
        split=args.split,
        requests=args.requests,
        rates=args.rates,
        policy=args.policy,
        sample_rate=args.sample_rate,
        adaptive=args.adaptive_policy,
        slo_s=args.slo_s,
        give_up_s=args.give_up_s,
        output_tokens=args.output_tokens,
        chunk_size=args.chunk_size,
        seed=args.seed,
        model=args.model,
        policy_dir=args.policy_dir,
        progress=not args.no_progress,
    )
    report = run_bench_shadow(options, args.out, command=_command_line())
    print(render_markdown(report))
    print(f"report: {args.out}/bench_shadow.md")
    return 0
