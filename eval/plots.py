"""PNG plots of an eval report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from ctxgate.eval.stats import percentile


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_quality_vs_compression(report: dict[str, Any], path: Path) -> None:
    """Accuracy and answer retention against compression ratio, one point per arm; sweep arms of
    the same base policy are joined into a curve."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    groups: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for label, arm in report["arms"].items():
        groups[arm["base_policy"] if arm.get("sweep_field") else label].append((label, arm))
    for group, members in groups.items():
        members = [(label, arm) for label, arm in members if arm["compression_ratio"] is not None]
        members.sort(key=lambda item: item[1]["compression_ratio"])
        if not members:
            continue
        ratios = [arm["compression_ratio"] for _, arm in members]
        for metric, marker, style in (("accuracy", "o", "-"), ("answer_retention", "s", "--")):
            values = [arm[metric]["value"] for _, arm in members]
            if all(value is None for value in values):
                continue
            lows = [arm[metric]["ci_low"] for _, arm in members]
            highs = [arm[metric]["ci_high"] for _, arm in members]
            errors = [
                [0 if v is None else v - lo for v, lo in zip(values, lows, strict=True)],
                [0 if v is None else hi - v for v, hi in zip(values, highs, strict=True)],
            ]
            axis.errorbar(
                ratios,
                [v if v is not None else float("nan") for v in values],
                yerr=errors,
                marker=marker,
                linestyle=style,
                capsize=3,
                label=f"{group}: {metric.replace('_', ' ')}",
            )
        for (_label, arm), ratio in zip(members, ratios, strict=True):
            if arm.get("sweep_field"):
                anchor = arm["accuracy"]["value"]
                anchor = anchor if anchor is not None else arm["answer_retention"]["value"] or 0
                axis.annotate(
                    str(arm["sweep_value"]),
                    (ratio, anchor),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
    axis.set_xlabel("compression ratio (original / sent prompt tokens)")
    axis.set_ylabel("share of questions")
    axis.set_ylim(-0.02, 1.02)
    axis.set_title("Quality vs compression (95% bootstrap intervals)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_ttft_distribution(rows: list[dict[str, Any]], arms: list[str], path: Path) -> None:
    """Empirical CDF of client-side TTFT per arm, P95 marked."""
    import numpy as np

    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label in arms:
        values = np.sort(
            [row["ttft_ms"] for row in rows if row["arm"] == label and row.get("ttft_ms") is not None]
        )
        if values.size == 0:
            continue
        shares = np.arange(1, values.size + 1) / values.size
        p95 = percentile(values.tolist(), 95)
        (line,) = axis.step(values, shares, where="post", label=f"{label} (P95 {p95:.0f} ms)")
        axis.axvline(p95, color=line.get_color(), linestyle=":", alpha=0.7)
    if not axis.lines:
        axis.text(
            0.5,
            0.5,
            "no TTFT measured (compress-only run or every request failed)",
            ha="center",
            va="center",
            transform=axis.transAxes,
        )
    axis.set_xlabel("time to first token, client-side (ms)")
    axis.set_ylabel("share of requests")
    axis.set_title("TTFT distribution per arm")
    axis.grid(alpha=0.3)
    if axis.lines:
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_tokens_saved_by_stage(report: dict[str, Any], path: Path) -> None:
    """Stacked bars: mean prompt tokens sent plus mean tokens each stage removed, per arm."""
    plt = _pyplot()
    labels = list(report["arms"])
    stages = sorted({stage for arm in report["arms"].values() for stage in arm["tokens_saved_by_stage"]})
    figure, axis = plt.subplots(figsize=(max(6, 1.2 * len(labels) + 3), 4.5))
    bottoms = [report["arms"][label]["prompt_tokens_mean"] or 0 for label in labels]
    axis.bar(labels, bottoms, label="sent", color="#555555")
    colours = plt.get_cmap("tab10")
    for index, stage in enumerate(stages):
        heights = [report["arms"][label]["tokens_saved_by_stage"].get(stage, 0) for label in labels]
        axis.bar(labels, heights, bottom=bottoms, label=f"saved: {stage}", color=colours(index % 10))
        bottoms = [bottom + height for bottom, height in zip(bottoms, heights, strict=True)]
    axis.set_ylabel("prompt tokens per request (mean)")
    axis.set_title("Prompt tokens sent and saved per stage")
    axis.tick_params(axis="x", labelrotation=20, labelsize=7)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_plots(report: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path) -> dict[str, str]:
    """Write every plot; returns {title: file name} for the report."""
    plots = {
        "Accuracy and retention vs compression ratio": "quality_vs_compression.png",
        "TTFT distribution per arm": "ttft_distribution.png",
        "Tokens saved per stage": "tokens_saved_by_stage.png",
    }
    files = iter(plots.values())
    plot_quality_vs_compression(report, out_dir / next(files))
    plot_ttft_distribution(rows, list(report["arms"]), out_dir / next(files))
    plot_tokens_saved_by_stage(report, out_dir / next(files))
    return plots
