"""`ctxgate eval ...` commands, and the `bench` group (eval/bench_cli.py) registered beside them
(import-light: work happens in the modules each command imports when it runs)."""

from __future__ import annotations

import argparse
import shlex
import sys

from ctxgate.backend.settings.cli_actions import (
    StoreWithDeprecatedAliases,
    at_least_one,
)
from ctxgate.eval.bench_cli import register_bench
from ctxgate.eval.cli_common import EVAL_EXTRA_HINT, add_gateway_args, quiet_http_logs, require_eval_extra
from ctxgate.eval.shadow_cli import register_eval_shadow

__all__ = ["EVAL_EXTRA_HINT", "register", "require_eval_extra"]


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_eval(subparsers)
    register_bench(subparsers)


def _register_eval(subparsers: argparse._SubParsersAction) -> None:
    evaluation = subparsers.add_parser("eval", help="quality A/B of policies and the regression gate")
    eval_sub = evaluation.add_subparsers(dest="eval_command", required=True)

    run = eval_sub.add_parser("run", help="run a QA dataset through the gateway under each policy")
    run.add_argument(
        "--input",
        "--dataset",
        dest="dataset",
        required=True,
        action=StoreWithDeprecatedAliases,
        deprecated=["--dataset"],
        help="JSONL with question, answers, passages (or a file "
        "name in ../shared/data/eval); --dataset is deprecated",
    )
    run.add_argument(
        "--policy",
        action="append",
        required=True,
        dest="policies",
        help="policy to evaluate (repeat; the first is the A/B baseline)",
    )
    run.add_argument(
        "--sweep",
        help="FIELD=V1,V2,...: variants of the last --policy, e.g. documents.max_tokens=100,200,400,800",
    )
    run.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1)")
    run.add_argument("--max-tokens", type=int, default=32, help="answer length cap (default 32)")
    run.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)"
    )
    run.add_argument(
        "--compress-only",
        action="store_true",
        help="no generation: only evidence retention and tokens from /v1/ctxgate/compress (fast)",
    )
    run.add_argument("--out", required=True, help="output directory for the report")
    add_gateway_args(run)
    run.set_defaults(func=_eval_run)

    retention = eval_sub.add_parser(
        "retention", help="answer retention, compression ratio and time per question, in process (fast)"
    )
    retention.add_argument(
        "--input",
        action="append",
        required=True,
        dest="datasets",
        help="JSONL dataset (repeat); a bare name is looked up in ../shared/data/eval",
    )
    retention.add_argument("--policy", required=True, help="policy name")
    retention.add_argument("--policy-dir", help="policy directory (default: the shipped policies)")
    retention.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="dotted policy field override, e.g. documents.max_tokens=200 (repeat)",
    )
    retention.add_argument(
        "--split",
        choices=["all", "tune", "test", "halves"],
        default="all",
        help="the tune half, the test half (halves share no gold passage), all, or "
        "halves: tune and test reported side by side (with --ratios)",
    )
    retention.add_argument(
        "--ratios",
        default=None,
        metavar="R,R,...",
        help="fixed compression ratios, e.g. 3,5,10: each question's documents budget cut "
        "to reach them; per hop count, with 95%% bootstrap intervals",
    )
    retention.add_argument("--limit", type=int, help="first N questions of the split")
    retention.add_argument("--out", help="write the per-question JSON here")
    retention.set_defaults(func=_eval_retention)

    curve = eval_sub.add_parser(
        "retention-curve",
        help="answer retention against compression ratio over a budget sweep, beside a peer compressor's output",
    )
    curve.add_argument(
        "--input",
        action="append",
        required=True,
        dest="datasets",
        help="JSONL dataset (repeat); a bare name is looked up in ../shared/data/eval",
    )
    curve.add_argument("--policy", default="rag-default", help="policy name (default rag-default)")
    curve.add_argument(
        "--split",
        choices=["all", "tune", "test"],
        default="test",
        help="first half of each file (tune), second half (test), or all (default test)",
    )
    curve.add_argument(
        "--limit", type=at_least_one, default=60, help="scored questions per dataset (default 60)"
    )
    curve.add_argument(
        "--budgets",
        default=None,
        metavar="N,N,...",
        help="documents.max_tokens values of the sweep (default 1000,700,560,400,300,200,150,100,60)",
    )
    curve.add_argument("--peer", help="the peer's JSON (eval/peers/longllmlingua_peer.py --out)")
    curve.add_argument("--reuse", help="take the policy's points from this curve.json instead of running it")
    curve.add_argument("--out", required=True, help="directory for curve.json and retention_vs_ratio.png")
    curve.set_defaults(func=_eval_retention_curve)

    fit_curve = eval_sub.add_parser(
        "fit-curve",
        help="retention under fitting: answer retention at prompt budgets falling from the policy's "
        "normal one to its fit floor (in process, fast)",
    )
    fit_curve.add_argument(
        "--input",
        action="append",
        required=True,
        dest="datasets",
        help="JSONL dataset (repeat); a bare name is looked up in ../shared/data/eval",
    )
    fit_curve.add_argument("--policy", default="rag-default", help="policy name (default rag-default)")
    fit_curve.add_argument("--policy-dir", help="policy directory (default: the shipped policies)")
    fit_curve.add_argument(
        "--steps",
        type=at_least_one,
        default=4,
        help="budgets from max_input_tokens to fit.min_context_tokens, geometrically spaced (default 4)",
    )
    fit_curve.add_argument(
        "--budgets", metavar="N,N,...", help="these prompt budgets instead of --steps, e.g. 2048,1024,512,256"
    )
    fit_curve.add_argument(
        "--split",
        choices=["all", "tune", "test"],
        default="all",
        help="which half of each file (default all)",
    )
    fit_curve.add_argument(
        "--limit", type=at_least_one, default=20, help="questions per dataset (default 20)"
    )
    fit_curve.add_argument("--out", help="write the curves' JSON here")
    fit_curve.set_defaults(func=_eval_fit_curve)

    message_context = eval_sub.add_parser(
        "message-context",
        help="context inside the messages: LangChain stuff-documents prompts through /v1/ctxgate/compress",
    )
    message_context.add_argument(
        "--input", default="nq-multidoc-dev.jsonl", help="NQ-style JSONL (default nq-multidoc-dev.jsonl)"
    )
    message_context.add_argument(
        "--offset",
        type=int,
        default=0,
        help="skip this many questions first (e.g. 100: questions held out from tuning)",
    )
    message_context.add_argument("--limit", type=at_least_one, default=100, help="questions (default 100)")
    message_context.add_argument("--policy", default="rag-default", help="policy (default rag-default)")
    message_context.add_argument(
        "--document-prompt",
        default="{page_content}",
        help="LangChain document prompt (default {page_content}, create_stuff_documents_chain's; "
        "'{title}\\n{page_content}' shows each passage's title)",
    )
    message_context.set_defaults(func=_eval_message_context)

    gate = eval_sub.add_parser("gate", help="fail when quality regressed against a baseline report")
    gate.add_argument("--baseline", required=True, help="OLD/report.json")
    gate.add_argument("--current", required=True, help="NEW/report.json")
    gate.add_argument(
        "--max-accuracy-drop",
        type=float,
        default=0.02,
        help="fail when a policy's accuracy fell by more than this, absolute 0..1 (default 0.02)",
    )
    gate.add_argument(
        "--max-retention-drop",
        type=float,
        default=0.02,
        help="fail when evidence retention fell by more than this, absolute 0..1 (default 0.02)",
    )
    gate.add_argument("--max-f1-drop", type=float, help="also gate token F1")
    gate.set_defaults(func=_eval_gate)

    register_eval_shadow(eval_sub)


def _eval_run(args: argparse.Namespace) -> int:
    require_eval_extra("eval run", "openai", "matplotlib", "pysbd")
    quiet_http_logs()
    from ctxgate.eval.runner import RunConfig, run_eval
    from ctxgate.eval.sweep import parse_sweep

    config = RunConfig(
        dataset=args.dataset,
        policies=args.policies,
        out_dir=args.out,
        limit=args.limit,
        concurrency=args.concurrency,
        url=args.url,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        sweep=parse_sweep(args.sweep) if args.sweep else None,
        policy_dir=args.policy_dir,
        model=args.model,
        api_key=args.api_key,
        progress=not args.no_progress,
        compress_only=args.compress_only,
        command="ctxgate " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["eval"] else "",
    )
    report = run_eval(config)
    for label, arm in report["arms"].items():
        accuracy = arm["accuracy"]
        accuracy_text = (
            "not measured"
            if accuracy["value"] is None
            else f"{accuracy['value']:.3f} [{accuracy['ci_low']:.3f}, {accuracy['ci_high']:.3f}]"
        )
        ttft = arm["ttft_ms"]["p95"]
        ttft_text = "" if ttft is None else f", TTFT P95 {ttft} ms"  # --compress-only generates nothing
        print(
            f"{label}: accuracy {accuracy_text}, "
            f"answer retained {_value(arm['answer_retention'])}, prompt tokens {arm['prompt_tokens_mean']}, "
            f"ratio {arm['compression_ratio']}{ttft_text}, errors {arm['errors']}"
        )
    print(f"report: {args.out}/report.md")
    return 0


def _eval_retention(args: argparse.Namespace) -> int:
    require_eval_extra("eval retention", "pysbd")
    from ctxgate.eval.retention import (
        parse_overrides,
        ratio_table,
        run_ratio_report,
        run_retention,
        write_json,
    )

    if args.ratios:
        ratios = [float(value) for value in args.ratios.split(",") if value.strip()]
        if not ratios or min(ratios) < 1:
            raise ValueError("--ratios must be compression ratios of at least 1, e.g. 3,5,10")
        splits = ("tune", "test") if args.split == "halves" else (args.split,)
        report = run_ratio_report(
            args.datasets,
            args.policy,
            parse_overrides(args.override),
            ratios,
            splits,
            args.limit,
            args.policy_dir,
        )
        print("\n".join(ratio_table(report)))
        if args.out:
            write_json(report, args.out)
        return 0
    if args.split == "halves":
        raise ValueError("--split halves needs --ratios")
    report = run_retention(
        args.datasets, args.policy, parse_overrides(args.override), args.split, args.limit, args.policy_dir
    )
    for name, result in report["datasets"].items():
        summary = result["summary"]
        print(
            f"{name} [{args.policy} {args.split}]: answer retained {summary['answer_retention']} "
            f"(n={summary['n_scored']}), ratio {summary['compression_ratio']}, compression ms "
            f"mean {summary['compression_ms_mean']} p95 {summary['compression_ms_p95']}"
        )
    if args.out:
        write_json(report, args.out)
    return 0


def _value(estimate: dict) -> str:
    return "–" if estimate.get("value") is None else f"{estimate['value']:.3f}"


def _eval_retention_curve(args: argparse.Namespace) -> int:
    require_eval_extra("eval retention-curve", "pysbd", "matplotlib")
    from ctxgate.eval.retention_curve import run_retention_curve

    budgets = [int(value) for value in args.budgets.split(",") if value.strip()] if args.budgets else None
    if budgets is not None and (not budgets or min(budgets) <= 0):
        raise ValueError("--budgets must be positive token counts, e.g. 1000,400,200")
    report = run_retention_curve(
        args.datasets,
        args.out,
        policy=args.policy,
        split=args.split,
        limit=args.limit,
        budgets=budgets,
        peer_path=args.peer,
        reuse_path=args.reuse,
    )
    for dataset, arms in report["curves"].items():
        for arm, points in arms.items():
            curve = ", ".join(f"{p['compression_ratio']}x: {p['answer_retention']}" for p in points)
            print(f"{dataset} {arm}: {curve}")
    print(f"report: {args.out}/curve.json")
    return 0


def _eval_fit_curve(args: argparse.Namespace) -> int:
    require_eval_extra("eval fit-curve", "pysbd")
    from ctxgate.eval.fit_curve import curve_table, run_fit_curve
    from ctxgate.eval.retention import write_json

    budgets = [int(value) for value in args.budgets.split(",") if value.strip()] if args.budgets else None
    if budgets is not None and (not budgets or min(budgets) < 16):
        raise ValueError("--budgets must be prompt budgets of at least 16 tokens, e.g. 2048,1024,512,256")
    report = run_fit_curve(
        args.datasets,
        args.policy,
        steps=args.steps,
        limit=args.limit,
        split=args.split,
        policy_dir=args.policy_dir,
        budgets=budgets,
    )
    print("\n".join(curve_table(report)))
    if args.out:
        write_json(report, args.out)
    return 0


def _eval_message_context(args: argparse.Namespace) -> int:
    require_eval_extra("eval message-context", "langchain_core", "langchain_openai")
    import json
    from dataclasses import asdict

    from ctxgate.eval.datasets import resolve_dataset_path
    from ctxgate.eval.langchain_context import measure

    if args.offset < 0:
        raise ValueError("--offset must be 0 or more")
    result = measure(
        resolve_dataset_path(args.input),
        args.limit,
        args.policy,
        args.document_prompt.replace("\\n", "\n"),
        args.offset,
    )
    print(json.dumps(asdict(result) | {"passed": result.passed}, indent=2))
    return 0 if result.passed else 1


def _eval_gate(args: argparse.Namespace) -> int:
    from ctxgate.eval.gate import run_gate
    from ctxgate.eval.report import load_report

    result = run_gate(
        load_report(args.baseline),
        load_report(args.current),
        max_accuracy_drop=args.max_accuracy_drop,
        max_retention_drop=args.max_retention_drop,
        max_f1_drop=args.max_f1_drop,
    )
    print(result.describe())
    return 0 if result.passed else 1
