"""`ctxgate bench route`: its flags and the function that runs it (eval/bench_route.py does the work)."""

from __future__ import annotations

import argparse

from ctxgate.backend.settings.cli_actions import at_least_one
from ctxgate.eval.cli_common import quiet_http_logs


def register_bench_route(bench_sub: argparse._SubParsersAction) -> None:
    route = bench_sub.add_parser(
        "route",
        help="routing strategies of a model group over real engine processes: prefix-cache hits, TTFT, "
        "requests/s; and a replica killed mid-way",
    )
    route.add_argument("--replicas", type=at_least_one, default=2, help="engine processes (default 2)")
    route.add_argument(
        "--conversations", type=at_least_one, default=8, help="multi-turn conversations (default 8)"
    )
    route.add_argument("--turns", type=at_least_one, default=4, help="turns per conversation (default 4)")
    route.add_argument(
        "--rag-requests",
        type=at_least_one,
        default=12,
        help="requests of the shared-system-prompt RAG workload (default 12)",
    )
    route.add_argument("--max-tokens", type=at_least_one, default=8, help="answer length (default 8)")
    route.add_argument(
        "--kv-cache-memory-mb",
        type=at_least_one,
        default=64,
        help="each replica's KV pool (default 64: too small to hold every conversation)",
    )
    route.add_argument("--model", help="model directory for the engines (default: the default model)")
    route.add_argument("--no-kill", action="store_true", help="skip the run with one replica killed half-way")
    route.add_argument(
        "--load-factor",
        type=float,
        default=1.25,
        help="cache affinity's bounded load: a replica takes a key while under this times its share of "
        "the requests in flight (default 1.25, as model_list[].load_factor)",
    )
    route.add_argument(
        "--via",
        choices=("gateway", "in-process"),
        default="gateway",
        help="gateway (default): through a real `ctxgate serve` process whose model list fronts the "
        "replicas, over HTTP; in-process: through a model group in the bench's own process",
    )
    route.add_argument("--out", default="bench-out/route", help="output directory (default bench-out/route)")
    route.set_defaults(func=_bench_route)


def _bench_route(args: argparse.Namespace) -> int:
    quiet_http_logs()
    from ctxgate.eval.bench_route import RouteBenchConfig, render_markdown, run_bench_route

    config = RouteBenchConfig(
        replicas=args.replicas,
        conversations=args.conversations,
        turns=args.turns,
        rag_requests=args.rag_requests,
        max_tokens=args.max_tokens,
        kv_cache_memory_mb=args.kv_cache_memory_mb,
        model=args.model,
        kill=not args.no_kill,
        via=args.via,
        load_factor=args.load_factor,
    )
    if config.kill and config.replicas < 2:
        raise ValueError("the kill run needs --replicas 2 or more (or --no-kill)")
    print(render_markdown(run_bench_route(config, args.out)))
    return 0
