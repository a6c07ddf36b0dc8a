"""Builds the runners for `ctxgate bench engine` from its command-line flags."""

from __future__ import annotations

import argparse
import logging
import os

from ctxgate.eval.bench_engine import (
    WORKLOADS,
    BenchOptions,
    EngineRunner,
    HFGenerateRunner,
    OpenAIServerRunner,
    run_benchmark,
    set_progress,
    write_report,
)

logger = logging.getLogger(__name__)


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    workloads = [name.strip().upper() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in workloads if name not in WORKLOADS]
    if unknown or not workloads:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    for flag in ("num_requests", "prompt_tokens", "output_tokens", "concurrency"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")
    if args.repeats <= 0 or args.max_attempts <= 0:
        raise ValueError("--repeats and --max-attempts must be positive")
    return BenchOptions(
        workloads=workloads,
        num_requests=args.num_requests,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        concurrency=args.concurrency,
        repeats=args.repeats,
        baseline=not args.no_baseline,
        busy_threshold=args.busy_threshold,
        max_attempts=args.max_attempts,
        seed=args.seed,
        exclude_pids=list(args.server_pid),
    )


def parse_peers(specs: list[str], target_name: str) -> list[tuple[str, str]]:
    """`NAME=URL` pairs; names must be unique and differ from the target's and the baseline's."""
    peers: list[tuple[str, str]] = []
    for spec in specs:
        name, separator, url = spec.partition("=")
        name, url = name.strip(), url.strip()
        if not separator or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--peer takes NAME=URL (e.g. vllm=http://127.0.0.1:8000), not {spec!r}")
        if name in (target_name, HFGenerateRunner.name) or name in {n for n, _ in peers}:
            raise ValueError(f"--peer name {name!r} is already taken")
        peers.append((name, url))
    return peers


def bench_engine_command(args: argparse.Namespace) -> int:
    import torch

    from ctxgate.backend.model.model_prepare import prepare_default_model
    from ctxgate.backend.model.tokenizer import load_tokenizer
    from ctxgate.backend.serving.cli import engine_config_from_args

    options = options_from_args(args)
    set_progress(not args.no_progress)
    peer_specs = parse_peers(args.peer, OpenAIServerRunner.name if args.url else EngineRunner.name)
    model_dir = str(args.model or prepare_default_model())
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    from ctxgate.backend.platform.cpu_features import cpu_path

    settings: dict = {
        "mode": "url" if args.url else "in-process",
        "model": model_dir,
        "threads": torch.get_num_threads(),
    }
    # Every figure names the CPU path that produced it: this machine's, and the engine's own choice.
    settings["cpu_path"] = cpu_path().as_dict()
    if args.url:
        tokenizer = load_tokenizer(model_dir)
        target = OpenAIServerRunner(
            args.url,
            args.served_model_name,
            tokenizer,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        )
        settings["url"] = args.url
        baseline_dtype = {"auto": torch.bfloat16}.get(args.dtype) or getattr(torch, args.dtype)
    else:
        from ctxgate.backend.engine.async_engine import AsyncEngine

        config = engine_config_from_args(args)
        if config.model is None:
            config.model = model_dir
        async_engine = AsyncEngine(config)
        tokenizer = async_engine.tokenizer
        target = EngineRunner(async_engine)
        baseline_dtype = async_engine.dtype
        settings["engine_config"] = {k: str(v) for k, v in vars(config).items()}
        settings["engine_path"] = async_engine.path_info
    peers = [OpenAIServerRunner(url, None, tokenizer, name=name) for name, url in peer_specs]
    settings["peers"] = {peer.name: peer.base_url for peer in peers}
    baseline_threads = None if args.url else async_engine.num_threads
    baseline_device = "cpu" if args.url else str(async_engine.path_info["device"])
    baseline = (
        HFGenerateRunner(model_dir, baseline_dtype, tokenizer, baseline_threads, baseline_device)
        if options.baseline
        else None
    )
    settings["baseline_device"] = baseline_device if baseline is not None else None
    settings["baseline_dtype"] = str(baseline_dtype) if baseline is not None else None
    print(
        f"bench engine: {settings['mode']}, model {model_dir}, torch threads {settings['threads']}, "
        f"baseline {settings['baseline_dtype']}"
    )
    print(f"bench engine: {cpu_path().summary()}")
    if "engine_path" in settings:
        print(f"bench engine: engine path {settings['engine_path']}")
    guided = None
    if args.guided_arm and not args.url:  # before the engine thread starts: the arm steps the engine itself
        from ctxgate.eval.bench_guided import guided_arm

        guided = guided_arm(async_engine.engine, output_tokens=args.output_tokens or 32)
        print(f"bench engine: guided arm {guided}")
    try:
        report = run_benchmark(target, baseline, tokenizer, options, peers=peers)
    finally:
        if not args.url:
            async_engine.shutdown()
    report["settings"] = settings
    report["options"] = vars(options)
    if guided is not None:
        report["guided_arm"] = guided
    if args.out:
        print(f"wrote {write_report(report, args.out)}")
    return 0
