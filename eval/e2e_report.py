"""`ctxgate bench e2e`'s figures: per-arm summaries, the acceptance bars, the markdown report and plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxgate.eval.e2e_samples import ARMS, CLOSED_LOOP_ONLY_CHECKS, PASSES, ArmRun, Sample
from ctxgate.eval.stats import p95_ratio_interval, percentile

if TYPE_CHECKING:
    from ctxgate.eval.bench_e2e import E2ERun


def latency(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None}
    return {"p50": round(percentile(values, 50), 2), "p95": round(percentile(values, 95), 2)}


def summarize_arm(runs: list[ArmRun]) -> dict[str, Any]:
    samples = [s for run in runs for s in run.samples if not s.error]
    wall = sum(run.wall_s for run in runs)
    output_tokens = sum(s.output_tokens for s in samples)
    return {
        "requests": len(samples),
        "errors": sum(1 for run in runs for s in run.samples if s.error),
        "wall_s": round(wall, 3),
        "req_s": round(len(samples) / wall, 4) if wall > 0 else None,
        "output_tok_s": round(output_tokens / wall, 3) if wall > 0 else None,
        "prompt_tokens_mean": round(statistics.fmean(s.prompt_tokens for s in samples), 1)
        if samples
        else None,
        "ttft_ms": latency([s.ttft_ms for s in samples]),
        "tpot_ms": latency([t for s in samples if (t := s.tpot_ms) is not None]),
        "e2e_ms": latency([s.e2e_ms for s in samples]),
        "prefill_ms": latency([s.prefill_ms for s in samples if s.prefill_ms is not None]),
        "compression_ms": latency([s.compression_ms for s in samples if s.compression_ms is not None]),
        "compression_stage_ms": stage_latencies(samples),
        "compression_wait_ms": latency(
            [s.compression_wait_ms for s in samples if s.compression_wait_ms is not None]
        ),
        "queue_ms": latency([s.queue_ms for s in samples if s.queue_ms is not None]),
        "compression_engine_ms": latency(
            [s.compression_engine_ms for s in samples if s.compression_engine_ms is not None]
        ),
        "cached_prompt_tokens_mean": round(statistics.fmean(s.cached_prompt_tokens for s in samples), 2)
        if samples
        else None,
        "others_cpu_frac_max": round(max((run.others_cpu_frac for run in runs), default=0.0), 3),
        "others_cpu_frac_mean": round(statistics.fmean(run.others_cpu_frac for run in runs), 3)
        if runs
        else None,
    }


def ttft_by_position(samples: list[Sample]) -> dict[str, list[float | None]]:
    """Median TTFT per place in a chunk's send order, per arm. In a closed loop the first
    `concurrency` requests of a chunk arrive together (a burst: the last of them waits for every
    prefill before its own), later ones as earlier ones finish; the arms' P95s come from these places."""
    positions = sorted({s.position for s in samples if s.position is not None and not s.error})
    by_arm: dict[str, list[float | None]] = {}
    for arm in ARMS:
        medians = []
        for position in positions:
            values = [s.ttft_ms for s in samples if s.arm == arm and s.position == position and not s.error]
            medians.append(round(statistics.median(values), 1) if values else None)
        if any(value is not None for value in medians):
            by_arm[arm] = medians
    return by_arm


def stage_latencies(samples: list[Sample]) -> dict[str, dict[str, float | None]]:
    """Where compression time goes, per stage (stages that took >= 1 ms at P95 in the arm)."""
    names = sorted({name for s in samples for name in s.compression_stage_ms})
    stages = {
        name: latency([s.compression_stage_ms[name] for s in samples if name in s.compression_stage_ms])
        for name in names
    }
    return {name: value for name, value in stages.items() if (value["p95"] or 0.0) >= 1.0}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


INTERVAL_CONFIDENCE = 0.9  # of the bootstrap intervals in the summary and the report


def compression_payback(samples: list[Sample]) -> dict[str, Any]:
    """Per question: compression ms against the prefill ms it saved (full's prefill - compressed's)."""
    by_question: dict[str, dict[str, Sample]] = {}
    for sample in samples:
        if not sample.error and sample.arm in ("full", "compressed"):
            by_question.setdefault(sample.question_id, {})[sample.arm] = sample
    saved, spent, shares = [], [], []
    for pair in by_question.values():
        full, compressed = pair.get("full"), pair.get("compressed")
        if not full or not compressed or full.prefill_ms is None or compressed.prefill_ms is None:
            continue
        prefill_saved = full.prefill_ms - compressed.prefill_ms
        saved.append(prefill_saved)
        spent.append(compressed.compression_ms or 0.0)
        if prefill_saved > 0:
            shares.append((compressed.compression_ms or 0.0) / prefill_saved)
    return {
        "questions": len(saved),
        "prefill_ms_saved": latency(saved) | {"mean": round(statistics.fmean(saved), 2) if saved else None},
        "compression_ms": latency(spent),
        # The acceptance figure: P95 over questions of compression ms / prefill ms saved (<= 0.1).
        "compression_share_of_saving_p95": round(percentile(shares, 95), 4) if shares else None,
        "compression_p95_over_saved_p50": ratio(percentile(spent, 95), percentile(saved, 50))
        if saved
        else None,
    }


def summarize_level(level: E2ERun) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pass_name in PASSES:
        runs = [run for name, run in level.runs if name == pass_name]
        if not runs:
            continue
        arms = {arm: summarize_arm([run for run in runs if run.arm == arm]) for arm in ARMS}
        req_s = {arm: arms[arm]["req_s"] for arm in ARMS}
        samples = [s for run in runs for s in run.samples]
        ttfts = {
            arm: [s.ttft_ms for s in samples if s.arm == arm and not s.error]
            for arm in ("compressed", "ideal")
        }
        out[pass_name] = {
            "arms": arms,
            "gain": ratio(req_s["compressed"], req_s["full"]),
            "efficiency": ratio(req_s["compressed"], req_s["ideal"]),
            "gateway_vs_engine_req_s": ratio(req_s["ideal"], req_s["engine"]),
            "gateway_vs_engine_tpot_p50": ratio(
                arms["ideal"]["tpot_ms"]["p50"], arms["engine"]["tpot_ms"]["p50"]
            ),
            "compressed_vs_ideal_ttft_p95": ratio(
                arms["compressed"]["ttft_ms"]["p95"], arms["ideal"]["ttft_ms"]["p95"]
            ),
            "compressed_vs_ideal_ttft_p95_interval": p95_ratio_interval(ttfts["compressed"], ttfts["ideal"]),
            "token_reduction": ratio(
                arms["full"]["prompt_tokens_mean"], arms["compressed"]["prompt_tokens_mean"]
            ),
            "payback": compression_payback(samples),
            "ttft_ms_by_position": ttft_by_position(samples),
        }
    return out


ACCEPTANCE = (
    # (name, pass, key path, comparison, bar)
    ("gateway passthrough req/s >= 0.9x engine-alone", "cold", ("gateway_vs_engine_req_s",), ">=", 0.9),
    ("gateway passthrough TPOT P50 <= 1.1x engine-alone", "cold", ("gateway_vs_engine_tpot_p50",), "<=", 1.1),
    ("efficiency (compressed/ideal req/s) >= 0.9, cold", "cold", ("efficiency",), ">=", 0.9),
    ("TTFT P95 compressed <= 1.1x ideal, cold", "cold", ("compressed_vs_ideal_ttft_p95",), "<=", 1.1),
    ("gain (compressed/full req/s) >= 3", "cold", ("gain",), ">=", 3.0),
    (
        "first-sight compression <= 1/10 of prefill saved (P95)",
        "cold",
        ("payback", "compression_share_of_saving_p95"),
        "<=",
        0.1,
    ),
)


def acceptance(level_summary: dict[str, Any], open_loop: bool = False) -> list[dict[str, Any]]:
    checks = []
    for name, pass_name, path, comparison, bar in ACCEPTANCE:
        value: Any = level_summary.get(pass_name, {})
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if open_loop and path[0] in CLOSED_LOOP_ONLY_CHECKS:
            value = None
        met = None if value is None else (value >= bar if comparison == ">=" else value <= bar)
        check = {"check": name, "value": value, "bar": f"{comparison} {bar}", "met": met}
        interval = level_summary.get(pass_name, {}).get(f"{path[0]}_interval") if len(path) == 1 else None
        if interval is not None and value is not None:  # a summary figure with a bootstrap interval beside it
            check["interval"] = interval
        checks.append(check)
    return checks


# ---------------------------------------------------------------------------- report
def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# End-to-end benchmark: saved prompt tokens as saved time",
        "",
        f"- Command: `{report['command']}`",
        f"- Dataset: `{report['dataset']}` ({report['questions']} questions), {report['output_tokens']} output "
        "tokens per request (ignore_eos), streamed, every prompt starts with a unique tag (no prefix-cache hits)",
        f"- Policies: compressed `{report['policy']}`, full `{report['full_policy']}`; "
        f"gateway embedder on the {report.get('embed_on', 'process')}"
        + (
            f", {report['compression_workers']} compression worker(s)"
            if "compression_workers" in report
            else ""
        )
        + (f" at nice {report['compression_nice']}" if "compression_nice" in report else "")
        + (
            f", engine step budget {report['max_num_batched_tokens']} tokens"
            if report.get("max_num_batched_tokens")
            else ""
        ),
        f"- CPU path: {report['cpu_path']}",
        f"- Machine load: other processes took up to {100 * report['others_cpu_frac_max']:.0f}% of the machine's "
        f"CPU during a chunk (mean {100 * report['others_cpu_frac_mean']:.0f}%); figures are noisy, compare ratios.",
        "",
    ]
    arrival_rate = report.get("arrival_rate")
    if arrival_rate:
        lines[-1:-1] = [
            f"- Open loop: requests arrive at {arrival_rate:g} requests/s (Poisson, the same schedule "
            "for every arm of a chunk) whether or not earlier ones finished; req/s is what an arm "
            "served of that, so gain, efficiency and passthrough req/s are left to closed-loop runs."
        ]
    for concurrency, level in report["levels"].items():
        label = level_label(int(concurrency), arrival_rate, long=True)
        for pass_name, summary in level["summary"].items():
            lines += [f"## {label[0].upper() + label[1:]}, {pass_name} pass", ""]
            lines += [
                "| arm | req/s | out tok/s | prompt tok | TTFT P50 / P95 ms | TPOT P50 / P95 ms | "
                "e2e P50 / P95 ms | prefill P50 ms | compression P50 / P95 ms | others' CPU max |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            ]
            for arm, row in summary["arms"].items():
                lines.append(
                    f"| {arm} | {_f(row['req_s'])} | {_f(row['output_tok_s'], 1)} | {_f(row['prompt_tokens_mean'], 0)} | "
                    f"{_pair(row['ttft_ms'])} | {_pair(row['tpot_ms'], 1)} | {_pair(row['e2e_ms'])} | "
                    f"{_f(row['prefill_ms']['p50'], 0)} | {_pair(row['compression_ms'], 1)} | "
                    f"{100 * row['others_cpu_frac_max']:.0f}% |"
                )
            payback = summary["payback"]
            lines += [
                "",
                f"- gain (compressed / full req/s): **{_f(summary['gain'], 2)}** "
                f"(prompt tokens {_f(summary['token_reduction'], 2)}x fewer); "
                f"efficiency (compressed / ideal req/s): **{_f(summary['efficiency'], 2)}**",
                f"- gateway with passthrough prompts vs engine alone: req/s x{_f(summary['gateway_vs_engine_req_s'], 2)}, "
                f"TPOT P50 x{_f(summary['gateway_vs_engine_tpot_p50'], 2)}; "
                f"TTFT P95 compressed / ideal: x{_f(summary['compressed_vs_ideal_ttft_p95'], 2)}"
                + _interval(
                    summary.get("compressed_vs_ideal_ttft_p95_interval"),
                    f" ({INTERVAL_CONFIDENCE:.0%} bootstrap interval ",
                    ")",
                ),
                f"- prefill ms saved per request (full - compressed): P50 {_f(payback['prefill_ms_saved']['p50'], 0)}, "
                f"mean {_f(payback['prefill_ms_saved']['mean'], 0)}; compression ms P50 / P95 "
                f"{_pair(payback['compression_ms'], 1)}; compression / saving P95 "
                f"{_f(payback['compression_share_of_saving_p95'], 3)}",
            ]
            compressed = summary["arms"].get("compressed") or {}
            stages = compressed.get("compression_stage_ms") or {}
            if stages:
                lines.append(
                    "- compressed arm, compression ms by stage (P50 / P95): "
                    + ", ".join(f"{name} {_pair(value, 1)}" for name, value in stages.items())
                )
            wait = compressed.get("compression_wait_ms") or {}
            if wait.get("p50") is not None:
                lines.append(
                    f"- compressed arm, ms waiting for a compression worker (P50 / P95, in TTFT, not in "
                    f"compression ms): {_pair(wait, 1)}"
                )
            engine_ms = compressed.get("compression_engine_ms") or {}
            if engine_ms.get("p50") is not None:
                lines.append(
                    "- compressed arm, ms its compression's embedding passes held the engine's thread (P50 / "
                    f"P95; every request in the engine waits meanwhile): {_pair(engine_ms, 1)}"
                )
            queues = {arm: (row.get("queue_ms") or {}) for arm, row in summary["arms"].items()}
            if any(queue.get("p50") is not None for queue in queues.values()):
                lines.append(
                    "- engine queue ms, from submission to the first step (P50 / P95, in TTFT; most of it "
                    "the wait for the step in progress): "
                    + ", ".join(
                        f"{arm} {_pair(queue, 1)}"
                        for arm, queue in queues.items()
                        if queue.get("p50") is not None
                    )
                )
            lines += render_positions(summary.get("ttft_ms_by_position") or {})
            lines.append("")
        lines += [
            f"### Acceptance at {label}",
            "",
            "| check | value | bar | met |",
            "| --- | --- | --- | --- |",
        ]
        for check in level["acceptance"]:
            met = "–" if check["met"] is None else ("yes" if check["met"] else "**no**")
            value = _f(check["value"]) + _interval(check.get("interval"), " [", "]")
            lines.append(f"| {check['check']} | {value} | {check['bar']} | {met} |")
        if any(check.get("interval") for check in level["acceptance"]):
            lines += [
                "",
                f"In brackets: a {INTERVAL_CONFIDENCE:.0%} bootstrap interval (each arm's requests "
                "resampled); a bar inside it is within this run's noise.",
            ]
        lines.append("")
    lines += [f"![requests/s and TTFT per arm]({report['plot']})", ""] if report.get("plot") else []
    return "\n".join(lines)


def render_positions(by_arm: dict[str, list[float | None]]) -> list[str]:
    """The TTFT-by-position table (ttft_by_position), with compressed / ideal where both ran."""
    if not by_arm:
        return []
    arms = list(by_arm)
    width = max(len(values) for values in by_arm.values())
    with_ratio = "compressed" in by_arm and "ideal" in by_arm
    lines = [
        "",
        "TTFT P50 ms by place in a chunk's send order (closed loop: the first `concurrency` are sent "
        "together, the others as earlier requests of the chunk finish):",
        "",
        "| place | " + " | ".join(arms) + (" | compressed / ideal |" if with_ratio else ""),
        "| --- |" + " --- |" * (len(arms) + with_ratio),
    ]
    for index in range(width):
        cells = [_f(by_arm[arm][index] if index < len(by_arm[arm]) else None, 0) for arm in arms]
        row = f"| {index + 1} | " + " | ".join(cells) + " |"
        if with_ratio:
            compressed, ideal = by_arm["compressed"], by_arm["ideal"]
            row += f" {_f(ratio(compressed[index], ideal[index]) if index < min(len(compressed), len(ideal)) else None, 2)} |"
        lines.append(row)
    return lines


def level_label(concurrency: int, arrival_rate: float | None, long: bool = False) -> str:
    if arrival_rate:
        return f"open loop at {arrival_rate:g} requests/s" if long else f"rate={arrival_rate:g}/s"
    return f"concurrency {concurrency}" if long else f"c={concurrency}"


def _interval(interval: list[float] | None, before: str, after: str) -> str:
    return f"{before}{interval[0]:.2f}-{interval[1]:.2f}{after}" if interval else ""


def _f(value: Any, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pair(values: dict[str, Any], digits: int = 0) -> str:
    return f"{_f(values['p50'], digits)} / {_f(values['p95'], digits)}"


def plot(report: dict[str, Any], path: Path) -> None:
    """Requests/s and TTFT P50/P95 per arm, one group per concurrency level (cold pass)."""
    from ctxgate.eval.plots import _pyplot

    try:
        plt = _pyplot()
    except ImportError:  # the offline GPU check carries no matplotlib: the JSON and markdown suffice
        return
    levels = list(report["levels"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(ARMS)
    for index, arm in enumerate(ARMS):
        positions = [i + (index - (len(ARMS) - 1) / 2) * width for i in range(len(levels))]
        rows = [report["levels"][c]["summary"]["cold"]["arms"][arm] for c in levels]
        left.bar(positions, [row["req_s"] or 0 for row in rows], width, label=arm)
        right.bar(
            positions, [row["ttft_ms"]["p95"] or 0 for row in rows], width, color=f"C{index}", alpha=0.35
        )
        right.bar(
            positions, [row["ttft_ms"]["p50"] or 0 for row in rows], width, color=f"C{index}", label=arm
        )
    for axis, title in ((left, "requests/s (cold pass)"), (right, "TTFT ms: P50 (solid) / P95 (light)")):
        axis.set_xticks(range(len(levels)), [level_label(int(c), report.get("arrival_rate")) for c in levels])
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
    left.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---------------------------------------------------------------------------- entry point
