"""`ctxgate bench ...`: each benchmark's flags and the function that runs it (import-light: the work
happens in the modules a command imports when it runs). `bench engine` belongs to the engine
(eval/bench_engine*.py); `bench prefill`, `e2e`, `slo`, `prefix`, `multiturn`, `route`, `gpu` and
`fairness` to the eval harness (`slo`, `route`, `shadow`, `multiturn` and `fairness` register their
own flags: eval/bench_slo_cli.py, bench_route_cli.py, shadow_cli.py, bench_multiturn.py,
bench_fairness_cli.py)."""

from __future__ import annotations

import argparse
import shlex
import sys

from ctxgate.backend.settings.cli_actions import (
    StoreWithDeprecatedAliases,
    at_least_one,
    nice_increment,
    positive_number,
)
from ctxgate.eval.bench_fairness_cli import register_bench_fairness
from ctxgate.eval.bench_route_cli import register_bench_route
from ctxgate.eval.bench_slo_cli import register_bench_slo
from ctxgate.eval.cli_common import add_gateway_args, quiet_http_logs, require_eval_extra
from ctxgate.eval.shadow_cli import register_bench_shadow


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="performance benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _register_bench_engine(bench_sub)
    _register_bench_prefill(bench_sub)
    _register_bench_e2e(bench_sub)
    gpu = bench_sub.add_parser(
        "gpu",
        help="the offline GPU check in stages (eval/gpu/check.py): install, "
        "random-weight models at real shapes, HF parity, W1-W3 vs HF and the roofline, e2e",
    )
    from ctxgate.eval.gpu.check import add_arguments

    add_arguments(gpu)
    gpu.set_defaults(func=_bench_gpu)
    register_bench_slo(bench_sub)
    register_bench_shadow(bench_sub)
    _register_bench_prefix(bench_sub)
    from ctxgate.eval.bench_multiturn import register as register_multiturn

    register_multiturn(bench_sub)
    register_bench_route(bench_sub)
    register_bench_fairness(bench_sub)


def _register_bench_prefill(bench_sub: argparse._SubParsersAction) -> None:
    prefill = bench_sub.add_parser(
        "prefill", help="measured prefill/TTFT saved by a policy, and the cost model"
    )
    prefill.add_argument(
        "--input",
        "--dataset",
        dest="dataset",
        required=True,
        action=StoreWithDeprecatedAliases,
        deprecated=["--dataset"],
        help="QA dataset JSONL, as for `eval run` (--dataset is deprecated)",
    )
    prefill.add_argument("--policy", required=True, help="the compressing policy")
    prefill.add_argument(
        "--full-policy", default="passthrough", help="the full-context arm (default passthrough)"
    )
    prefill.add_argument("--warmup", type=int, default=2, help="unmeasured warm-up requests (default 2)")
    prefill.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    add_gateway_args(prefill)
    prefill.set_defaults(func=_bench_prefill)


def _bench_prefill(args: argparse.Namespace) -> int:
    require_eval_extra("bench prefill", "openai")
    quiet_http_logs()
    from ctxgate.eval.bench_prefill import run_bench_prefill

    result = run_bench_prefill(
        dataset_path=args.dataset,
        policy=args.policy,
        out_dir=args.out,
        url=args.url,
        limit=args.limit,
        full_policy=args.full_policy,
        warmup=args.warmup,
        model=args.model,
        policy_dir=args.policy_dir,
        api_key=args.api_key,
        progress=not args.no_progress,
    )
    print(open(f"{args.out}/bench_prefill.md").read())
    for error in result["errors"][:10]:
        print(f"error: {error}")
    print(f"cost model: {args.out}/prefill_cost.json")
    return 0


def _register_bench_engine(bench_sub: argparse._SubParsersAction) -> None:
    from ctxgate.backend.serving.cli import (
        add_engine_arguments,  # argparse only: keeps `ctxgate --help` instant
    )

    engine = bench_sub.add_parser(
        "engine",
        help="workloads W1-W3 against the engine (or --url server) and the HF generate baseline",
    )
    engine.add_argument("--url", default=None, help="benchmark this OpenAI-compatible server instead")
    engine.add_argument(
        "--served-model-name",
        "--model-name",
        dest="served_model_name",
        default=None,
        action=StoreWithDeprecatedAliases,
        deprecated=["--model-name"],
        help="model id to request in --url mode (default: the server's first; --model-name is deprecated)",
    )
    engine.add_argument(
        "--api-key",
        default=None,
        help="bearer key for --url (a ctxgate gateway with a keys file); default $OPENAI_API_KEY",
    )
    engine.add_argument("--no-progress", action="store_true", help="no progress bars")
    engine.add_argument(
        "--server-pid",
        type=int,
        action="append",
        default=[],
        help="in --url mode, the server's pid: its CPU time is not counted as a neighbour's",
    )
    engine.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="another OpenAI-compatible server (vLLM, llama.cpp) run interleaved with the target on the "
        "same prompts; repeatable. Pass its pid with --server-pid so its CPU is not a neighbour's",
    )
    engine.add_argument("--workloads", default="W1,W2,W3", help="comma-separated subset of W1,W2,W3")
    engine.add_argument("--num-requests", type=int, default=None, help="scale every workload to N requests")
    engine.add_argument("--prompt-tokens", type=int, default=None, help="override prompt length")
    engine.add_argument("--output-tokens", type=int, default=None, help="override output length")
    engine.add_argument("--concurrency", type=int, default=None, help="override concurrency")
    engine.add_argument("--repeats", type=int, default=1, help="A/B repetitions per workload (interleaved)")
    engine.add_argument("--no-baseline", action="store_true", help="skip the HF generate baseline")
    engine.add_argument(
        "--guided-arm",
        action="store_true",
        help="also measure decode at batch 16 with a JSON-schema grammar mask against unconstrained "
        "(interleaved), and the mask's cost per token (in-process engine only)",
    )
    engine.add_argument(
        "--busy-threshold",
        type=float,
        default=0.10,
        help="repeat a run when other processes used more than this share of the machine's CPU",
    )
    engine.add_argument("--max-attempts", type=int, default=3, help="attempts per run with a busy neighbour")
    engine.add_argument("--seed", type=int, default=0, help="prompt generation seed")
    engine.add_argument("--out", default=None, help="directory for bench_engine.json")
    add_engine_arguments(engine)
    engine.set_defaults(func=_bench_engine)


def _bench_engine(args: argparse.Namespace) -> int:
    from ctxgate.eval.bench_engine_cli import bench_engine_command

    return bench_engine_command(args)


def _register_bench_e2e(bench_sub: argparse._SubParsersAction) -> None:
    e2e = bench_sub.add_parser(
        "e2e", help="full / compressed / ideal / engine-alone arms: do saved prompt tokens become saved time?"
    )
    e2e.add_argument(
        "--input",
        dest="dataset",
        default="nq-multidoc-dev.jsonl",
        help="QA JSONL (default nq-multidoc-dev.jsonl)",
    )
    e2e.add_argument("--limit", type=int, default=24, help="first N questions (default 24)")
    e2e.add_argument("--concurrency", default="4", help="comma-separated levels, e.g. 1,4,16 (default 4)")
    e2e.add_argument(
        "--output-tokens", type=int, default=32, help="tokens generated per request (default 32)"
    )
    e2e.add_argument("--policy", default="rag-default", help="the compressing policy (default rag-default)")
    e2e.add_argument(
        "--full-policy", default="passthrough", help="the full-context policy (default passthrough)"
    )
    e2e.add_argument("--no-warm-pass", action="store_true", help="skip the second (warm-cache) pass")
    e2e.add_argument(
        "--rounds-per-chunk",
        type=int,
        default=2,
        help="closed-loop rounds per interleaved chunk (chunk = concurrency x this; default 2)",
    )
    e2e.add_argument(
        "--model", help="model directory for the gateway and the engine (default: the default model)"
    )
    e2e.add_argument("--policy-dir", help="extra policy directory for the gateway")
    e2e.add_argument("--out", default="bench-out/e2e", help="output directory (default bench-out/e2e)")
    e2e.add_argument("--no-progress", action="store_true", help="no per-chunk progress lines")
    e2e.add_argument(
        "--engine-server",
        action="store_true",
        help="engine-alone arm over HTTP (`ctxgate engine serve`) instead of the engine in this process",
    )
    e2e.add_argument(
        "--embed-on",
        choices=("engine", "process"),
        default="engine",
        help="the gateway's `serve --embed-on`: where its embedding model runs (default engine)",
    )
    e2e.add_argument(
        "--compression-workers",
        type=at_least_one,
        default=None,
        metavar="N",
        help="the gateway's `serve --compression-workers` (default: its own, one per two cores)",
    )
    e2e.add_argument(
        "--compression-nice",
        type=nice_increment,
        default=None,
        metavar="N",
        help="the gateway's `serve --compression-nice` (default: its own)",
    )
    e2e.add_argument(
        "--max-num-batched-tokens",
        type=at_least_one,
        default=None,
        metavar="N",
        help="the engine's token budget per step, for the gateway's engine and the engine-alone arm "
        "(default: the engine's own)",
    )
    e2e.add_argument(
        "--arrival-rate",
        type=positive_number,
        default=None,
        metavar="R",
        help="open loop: requests arrive at R requests/s (Poisson, the same schedule for every arm) "
        "instead of --concurrency clients that wait for their replies; one level, chunks of "
        "4 x --rounds-per-chunk requests; req/s-based checks are left to closed-loop runs",
    )
    e2e.set_defaults(func=_bench_e2e)


def _bench_gpu(args: argparse.Namespace) -> int:
    from ctxgate.eval.gpu.check import run_check

    return run_check(args)


def _bench_e2e(args: argparse.Namespace) -> int:
    # Without matplotlib (the offline GPU check) the report is written without its plot.
    quiet_http_logs()
    from ctxgate.eval.bench_e2e import run_bench_e2e
    from ctxgate.eval.e2e_report import render_markdown
    from ctxgate.eval.e2e_samples import E2EOptions

    levels = [int(value) for value in args.concurrency.split(",") if value.strip()]
    if not levels or min(levels) <= 0 or args.output_tokens <= 0 or args.rounds_per_chunk <= 0:
        raise ValueError("--concurrency, --output-tokens and --rounds-per-chunk must be positive")
    options = E2EOptions(
        dataset=args.dataset,
        limit=args.limit,
        concurrencies=levels,
        output_tokens=args.output_tokens,
        policy=args.policy,
        full_policy=args.full_policy,
        warm_pass=not args.no_warm_pass,
        rounds_per_chunk=args.rounds_per_chunk,
        model=args.model,
        policy_dir=args.policy_dir,
        progress=not args.no_progress,
        engine_server=args.engine_server,
        embed_on=args.embed_on,
        compression_workers=args.compression_workers,
        compression_nice=args.compression_nice,
        max_num_batched_tokens=args.max_num_batched_tokens,
        arrival_rate=args.arrival_rate,
    )
    from ctxgate.backend.platform.cpu_features import cpu_path

    print(f"bench e2e: {cpu_path().summary()}")
    report = run_bench_e2e(options, args.out, command="ctxgate " + shlex.join(sys.argv[1:]))
    print(render_markdown(report))
    print(f"report: {args.out}/bench_e2e.md")
    return 0


def _register_bench_prefix(bench_sub: argparse._SubParsersAction) -> None:
    prefix = bench_sub.add_parser(
        "prefix",
        help="prefix-cache hit rate across compressed prompts sharing passages: policy order vs stable",
    )
    prefix.add_argument(
        "--input",
        dest="dataset",
        default="nq-multidoc-dev.jsonl",
        help="QA JSONL (default nq-multidoc-dev.jsonl)",
    )
    prefix.add_argument(
        "--policy", default="rag-default", help="packaged compressing policy (default rag-default)"
    )
    prefix.add_argument("--limit", type=int, default=24, help="requests per arm (default 24)")
    prefix.add_argument("--retention-limit", type=int, default=100, help="questions for the retention check")
    prefix.add_argument("--model", help="model directory for the gateway (default: the default model)")
    prefix.add_argument(
        "--out", default="bench-out/prefix", help="output directory (default bench-out/prefix)"
    )
    prefix.set_defaults(func=_bench_prefix_reuse)


def _bench_prefix_reuse(args: argparse.Namespace) -> int:
    quiet_http_logs()
    from ctxgate.eval.bench_prefix import render_markdown, run_bench_prefix

    if args.limit <= 0 or args.retention_limit <= 0:
        raise ValueError("--limit and --retention-limit must be positive")
    report = run_bench_prefix(
        args.dataset, args.policy, args.limit, args.retention_limit, args.out, args.model
    )
    print(render_markdown(report))
    return 0
