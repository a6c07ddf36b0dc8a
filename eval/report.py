"""Aggregate per-question rows into report.json and report.md.

report.json is the machine-readable contract the regression gate reads: per arm, every metric as
{value, ci_low, ci_high, n} where an interval makes sense, plus per-question scores so two reports
can be compared question by question (paired bootstrap).
"""

from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from ctxgate.eval.stats import Estimate, bootstrap_mean, paired_bootstrap_difference, percentiles

REPORT_SCHEMA_VERSION = 1
# The per-question scores the gate compares; `answer_retention` is the headline evidence measure.
QUALITY_METRICS = {
    "accuracy": "correct",
    "exact_match": "exact_match",
    "f1": "f1",
    "answer_retention": "answer_retained",
    "gold_passage_retention": "gold_passages_retained",
    "supporting_sentence_retention": "supporting_sentences_retained",
}


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value)


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def _numbers(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if isinstance(row.get(key), int | float)]


def summarize_arm(rows: list[dict[str, Any]], concurrency: int, seed: int = 0) -> dict[str, Any]:
    ok_rows = [row for row in rows if not row.get("error")]
    summary: dict[str, Any] = {"n": len(rows), "errors": len(rows) - len(ok_rows)}
    for metric, key in QUALITY_METRICS.items():
        # Errors count as wrong answers (a failed request is a failed answer), but retention is
        # only defined where the compressed context could be read.
        summary[metric] = bootstrap_mean([_as_float(row.get(key)) for row in rows], seed=seed).to_dict()

    original = _numbers(ok_rows, "original_prompt_tokens")
    sent = _numbers(ok_rows, "prompt_tokens")
    summary["original_prompt_tokens_mean"] = _mean(original)
    summary["prompt_tokens_mean"] = _mean(sent)
    summary["prompt_tokens"] = percentiles(sent)
    # Ratio of totals: robust to a few near-empty prompts, and what "4x fewer tokens" means.
    summary["compression_ratio"] = round(sum(original) / sum(sent), 3) if sent and sum(sent) else None
    summary["tokens_saved_mean"] = (
        round(summary["original_prompt_tokens_mean"] - summary["prompt_tokens_mean"], 3)
        if original and sent
        else None
    )

    saved_by_stage: dict[str, list[float]] = defaultdict(list)
    ms_by_stage: dict[str, list[float]] = defaultdict(list)
    compression_total_ms: list[float] = []
    for row in ok_rows:
        for stage, tokens in (row.get("saved_tokens") or {}).items():
            saved_by_stage[stage].append(float(tokens))
        stage_ms = row.get("compression_ms") or {}
        for stage, ms in stage_ms.items():
            ms_by_stage[stage].append(float(ms))
        compression_total_ms.append(sum(float(ms) for ms in stage_ms.values()))
    count = max(1, len(ok_rows))
    summary["tokens_saved_by_stage"] = {
        stage: round(sum(v) / count, 3) for stage, v in saved_by_stage.items()
    }
    summary["compression_ms"] = {
        **{key: value for key, value in percentiles(compression_total_ms, (50, 95)).items()},
        "by_stage": {stage: percentiles(values, (50, 95)) for stage, values in ms_by_stage.items()},
    }

    summary["compression_ms_first_sight"] = percentiles(
        _numbers(ok_rows, "compression_ms_first_sight"), (50, 95)
    )
    for key in ("ttft_ms", "tpot_ms", "latency_ms", "server_ttft_ms", "prefill_ms", "queue_ms"):
        summary[key] = percentiles(_numbers(ok_rows, key))
    summary["cached_prompt_tokens_mean"] = _mean(_numbers(ok_rows, "cached_prompt_tokens"))

    busy_s = sum(_numbers(ok_rows, "latency_ms")) / 1000
    completion = sum(_numbers(ok_rows, "completion_tokens"))
    # Arms are interleaved in one run, so per-arm throughput is estimated from the time its own
    # requests were in flight (with `concurrency` requests sharing the machine).
    summary["throughput"] = {
        "requests_per_s": round(len(ok_rows) * concurrency / busy_s, 4) if busy_s else None,
        "output_tokens_per_s": round(completion * concurrency / busy_s, 3) if busy_s else None,
    }
    summary["per_question"] = {
        row["id"]: {metric: row.get(key) for metric, key in QUALITY_METRICS.items()} for row in rows
    }
    return summary


def compare_arms(baseline: dict[str, Any], candidate: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """candidate - baseline for each quality metric, paired by question, with its interval."""
    differences: dict[str, Any] = {}
    for metric in QUALITY_METRICS:
        base_scores = {qid: _as_float(s.get(metric)) for qid, s in baseline["per_question"].items()}
        cand_scores = {qid: _as_float(s.get(metric)) for qid, s in candidate["per_question"].items()}
        estimate: Estimate = paired_bootstrap_difference(base_scores, cand_scores, seed=seed)
        differences[metric] = {**estimate.to_dict(), "significant": estimate.excludes_zero}
    return differences


def build_report(
    rows: list[dict[str, Any]], variants: list[Any], dataset: Any, config: Any, wall_s: float
) -> dict[str, Any]:
    by_arm: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_arm[row["arm"]].append(row)
    arms: dict[str, Any] = {}
    for variant in variants:
        arm = summarize_arm(by_arm.get(variant.label, []), config.concurrency)
        arm.update(
            policy=variant.policy,
            base_policy=variant.base_policy,
            sweep_field=variant.sweep_field,
            sweep_value=variant.sweep_value,
        )
        arms[variant.label] = arm

    labels = [variant.label for variant in variants]
    comparisons = [
        {"baseline": labels[0], "candidate": label, "difference": compare_arms(arms[labels[0]], arms[label])}
        for label in labels[1:]
    ]
    sweep = None
    if config.sweep is not None:
        sweep = {
            "field": config.sweep.field,
            "base_policy": config.policies[-1],
            "rows": [
                {
                    "value": variant.sweep_value,
                    "arm": variant.label,
                    "policy": variant.policy,
                    "compression_ratio": arms[variant.label]["compression_ratio"],
                    "prompt_tokens_mean": arms[variant.label]["prompt_tokens_mean"],
                    "accuracy": arms[variant.label]["accuracy"],
                    "answer_retention": arms[variant.label]["answer_retention"],
                    "gold_passage_retention": arms[variant.label]["gold_passage_retention"],
                    "ttft_ms_p95": arms[variant.label]["ttft_ms"]["p95"],
                }
                for variant in variants
                if variant.sweep_field is not None
            ],
        }
    total_requests = len(rows)
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": config.command,
        "dataset": {
            "path": dataset.path,
            "name": dataset.name,
            "sha256": dataset.sha256,
            "questions": len(dataset.examples),
        },
        "settings": {
            "policies": config.policies,
            "sweep": config.sweep.label("|".join(map(str, config.sweep.values))) if config.sweep else None,
            "limit": config.limit,
            "concurrency": config.concurrency,
            "max_tokens": config.max_tokens,
            "temperature": config.temperature,
            "compress_only": bool(getattr(config, "compress_only", False)),
            "gateway": config.url or "started for this run on a free port",
            "cpu_path": cpu_path_line(),
        },
        "run": {
            "wall_s": round(wall_s, 3),
            "requests": total_requests,
            "requests_per_s": round(total_requests / wall_s, 4) if wall_s else None,
        },
        "arms": arms,
        "comparisons": comparisons,
        "sweep": sweep,
    }


# --- Markdown ------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _fmt_estimate(estimate: dict[str, Any]) -> str:
    if estimate.get("value") is None:
        return "–"
    return f"{estimate['value']:.3f} [{estimate['ci_low']:.3f}, {estimate['ci_high']:.3f}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def cpu_path_line() -> str:
    """The CPU and engine path of the machine that produced a report's figures."""
    from ctxgate.backend.platform.cpu_features import cpu_path
    from ctxgate.compression.embedding.precision import precision_for_this_cpu

    return f"{cpu_path().summary()}; embedder {precision_for_this_cpu()}"


def render_markdown(report: dict[str, Any]) -> str:
    arms = report["arms"]
    settings = report["settings"]
    lines = [
        f"# ctxgate eval — {report['dataset']['name']}",
        "",
        f"- Command: `{report['command']}`" if report.get("command") else "- Command: (API call)",
        f"- Dataset: `{report['dataset']['path']}` ({report['dataset']['questions']} questions, "
        f"sha256 {report['dataset']['sha256'][:12]})",
        f"- Gateway: {settings['gateway']}; concurrency {settings['concurrency']}; "
        f"max_tokens {settings['max_tokens']}; temperature {settings['temperature']}",
        f"- Run: {report['run']['requests']} requests in {report['run']['wall_s']:.1f} s; created {report['created_at']}",
        f"- Machine: {settings.get('cpu_path', 'not recorded')}",
        "",
        "Intervals are 95% percentile-bootstrap intervals over questions."
        + (
            " Compress-only run: nothing was generated, so answer scores and latencies are not measured."
            if settings.get("compress_only")
            else ""
        ),
        "",
        "## Quality",
        "",
    ]
    lines += _table(
        ["arm", "n", "errors", "accuracy", "exact match", "F1", "answer retained", "gold passage kept"],
        [
            [
                label,
                str(arm["n"]),
                str(arm["errors"]),
                _fmt_estimate(arm["accuracy"]),
                _fmt_estimate(arm["exact_match"]),
                _fmt_estimate(arm["f1"]),
                _fmt_estimate(arm["answer_retention"]),
                _fmt_estimate(arm["gold_passage_retention"]),
            ]
            for label, arm in arms.items()
        ],
    )
    lines += ["## Tokens and compression", ""]
    lines += _table(
        [
            "arm",
            "original tokens (mean)",
            "sent tokens (mean)",
            "ratio",
            "saved by stage (mean)",
            "compression ms P50",
            "compression ms P95",
            "first-sight P50",
            "first-sight P95",
        ],
        [
            [
                label,
                _fmt(arm["original_prompt_tokens_mean"], 1),
                _fmt(arm["prompt_tokens_mean"], 1),
                _fmt(arm["compression_ratio"], 2),
                ", ".join(f"{stage} {tokens:.0f}" for stage, tokens in arm["tokens_saved_by_stage"].items())
                or "–",
                _fmt(arm["compression_ms"]["p50"], 2),
                _fmt(arm["compression_ms"]["p95"], 2),
                _fmt(arm.get("compression_ms_first_sight", {}).get("p50"), 2),
                _fmt(arm.get("compression_ms_first_sight", {}).get("p95"), 2),
            ]
            for label, arm in arms.items()
        ],
    )
    lines += [
        'Compression ms is measured on the chat request; "first sight" on the preceding '
        "/v1/ctxgate/compress call, when the passages are new to the embedding cache.",
        "",
    ]
    lines += ["## Latency (ms; client-side TTFT/TPOT/end-to-end, server-side prefill)", ""]
    lines += _table(
        [
            "arm",
            "TTFT P50",
            "TTFT P95",
            "TTFT P99",
            "TPOT P50",
            "TPOT P95",
            "e2e P50",
            "e2e P95",
            "e2e P99",
            "prefill P50",
            "prefill P95",
            "req/s",
            "out tok/s",
        ],
        [
            [label]
            + [_fmt(arm["ttft_ms"][p], 1) for p in ("p50", "p95", "p99")]
            + [_fmt(arm["tpot_ms"][p], 1) for p in ("p50", "p95")]
            + [_fmt(arm["latency_ms"][p], 1) for p in ("p50", "p95", "p99")]
            + [_fmt(arm["prefill_ms"][p], 1) for p in ("p50", "p95")]
            + [
                _fmt(arm["throughput"]["requests_per_s"], 3),
                _fmt(arm["throughput"]["output_tokens_per_s"], 1),
            ]
            for label, arm in arms.items()
        ],
    )
    if report["comparisons"]:
        lines += ["## A/B differences (candidate − baseline, paired by question)", ""]
        rows = []
        for comparison in report["comparisons"]:
            for metric in ("accuracy", "answer_retention", "f1"):
                diff = comparison["difference"][metric]
                verdict = "real difference" if diff["significant"] else "within noise"
                rows.append(
                    [
                        comparison["candidate"],
                        comparison["baseline"],
                        metric,
                        _fmt_estimate(diff),
                        verdict if diff["value"] is not None else "–",
                    ]
                )
        lines += _table(["candidate", "baseline", "metric", "difference [95% CI]", "verdict"], rows)
    if report.get("sweep"):
        sweep = report["sweep"]
        lines += [f"## Sweep of `{sweep['field']}` on `{sweep['base_policy']}`", ""]
        lines += _table(
            [
                sweep["field"],
                "ratio",
                "sent tokens",
                "accuracy",
                "answer retained",
                "gold passage kept",
                "TTFT P95",
            ],
            [
                [
                    str(row["value"]),
                    _fmt(row["compression_ratio"], 2),
                    _fmt(row["prompt_tokens_mean"], 1),
                    _fmt_estimate(row["accuracy"]),
                    _fmt_estimate(row["answer_retention"]),
                    _fmt_estimate(row["gold_passage_retention"]),
                    _fmt(row["ttft_ms_p95"], 1),
                ]
                for row in sweep["rows"]
            ],
        )
    if report.get("plots"):
        lines += ["## Plots", ""]
        for title, file_name in report["plots"].items():
            lines += [f"![{title}]({file_name})", ""]
    return "\n".join(lines)


def write_report_files(report: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    (out_dir / "report.md").write_text(render_markdown(report))


def load_report(path: str | Path) -> dict[str, Any]:
    report_path = Path(path)
    if not report_path.is_file():
        raise FileNotFoundError(f"report not found: {report_path}")
    try:
        report = json.loads(report_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{report_path}: not valid JSON ({exc.msg})") from exc
    if not isinstance(report, dict) or "arms" not in report:
        raise ValueError(f"{report_path}: not a ctxgate eval report (no 'arms')")
    return report
