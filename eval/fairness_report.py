"""The noisy-neighbour report of `ctxgate bench fairness`: per arm, B's TTFT, A's goodput and each
tenant's share of the prefill tokens served; the ratios the issue's bars are stated in."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ctxgate.eval.bench_fairness import ARMS, NOISY, QUIET, FairnessOptions
from ctxgate.eval.stats import p95_ratio_interval, percentiles

# The bars: with fair queuing B's TTFT P95 within 1.5x its P95 alone, and A keeping 90% of its goodput.
QUIET_P95_BAR = 1.5
NOISY_GOODPUT_BAR = 0.9


def _arm(outcomes: list[dict[str, Any]], arm: str, served_s: float) -> dict[str, Any]:
    rows = [row for row in outcomes if row["arm"] == arm]
    quiet = [row for row in rows if row["tenant"] == QUIET]
    noisy = [row for row in rows if row["tenant"] == NOISY]
    # Goodput: A's requests answered in full while the arm ran (those cut at its end do not count),
    # per second of the arm: A's load lasts until B's last answer, so each arm's length differs.
    noisy_done = [row for row in noisy if row["status"] == "ok"]
    prefill = {
        tenant: sum(row["prompt_tokens"] for row in rows if row["tenant"] == tenant and row["status"] == "ok")
        for tenant in (NOISY, QUIET)
    }
    total = sum(prefill.values())
    return {
        "seconds": round(served_s, 1),
        "quiet_requests": len(quiet),
        "quiet_ok": sum(row["status"] == "ok" for row in quiet),
        "quiet_ttft_s": percentiles([row["ttft_s"] for row in quiet if row["status"] == "ok"]),
        "noisy_sent": len(noisy),
        "noisy_statuses": _counts(row["status"] for row in noisy),
        "noisy_goodput_rps": round(len(noisy_done) / served_s, 3),
        "noisy_prefill_tokens_per_s": round(prefill[NOISY] / served_s, 1),
        "prefill_tokens": prefill,
        "prefill_share": {
            tenant: round(tokens / total, 4) if total else None for tenant, tokens in prefill.items()
        },
    }


def _counts(statuses) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status in statuses:
        counts[status] = counts.get(status, 0) + 1
    return dict(sorted(counts.items()))


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def summarize(raw: dict[str, Any], options: FairnessOptions) -> dict[str, Any]:
    outcomes = raw["outcomes"]
    arms = {arm: _arm(outcomes, arm, raw["arm_seconds"][arm]) for arm in ARMS}

    def quiet_ttfts(arm: str) -> list[float]:
        return [
            row["ttft_s"]
            for row in outcomes
            if row["arm"] == arm and row["tenant"] == QUIET and row["ttft_s"] is not None
        ]

    alone_p95 = arms["alone"]["quiet_ttft_s"]["p95"]
    ratios = {
        "quiet_p95_fair_vs_alone": _ratio(arms["fair"]["quiet_ttft_s"]["p95"], alone_p95),
        "quiet_p95_fifo_vs_alone": _ratio(arms["fifo"]["quiet_ttft_s"]["p95"], alone_p95),
        "quiet_p95_fair_vs_alone_interval": p95_ratio_interval(quiet_ttfts("fair"), quiet_ttfts("alone")),
        "noisy_goodput_fair_vs_fifo": _ratio(
            arms["fair"]["noisy_goodput_rps"], arms["fifo"]["noisy_goodput_rps"]
        ),
    }
    return {
        "options": asdict(options),
        "capacity_rps": round(raw["capacity_rps"], 3),
        "noisy_rate_rps": round(raw["noisy_rate"], 3),
        "arms": arms,
        "ratios": ratios,
        "bars": {
            "quiet_p95_within_1_5x_alone": _at_most(ratios["quiet_p95_fair_vs_alone"], QUIET_P95_BAR),
            "noisy_keeps_90pct_goodput": _at_least(ratios["noisy_goodput_fair_vs_fifo"], NOISY_GOODPUT_BAR),
        },
        "outcomes": outcomes,
    }


def _at_most(value: float | None, bar: float) -> bool | None:
    return None if value is None else value <= bar


def _at_least(value: float | None, bar: float) -> bool | None:
    return None if value is None else value >= bar


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def render_markdown(report: dict[str, Any]) -> str:
    options = report["options"]
    lines = [
        "# Noisy neighbour: weighted fair queuing",
        "",
        f"A ({NOISY}): {options['noisy_prompt_tokens']}-token prompts at {report['noisy_rate_rps']} req/s "
        f"({options['overload']}x the measured capacity of {report['capacity_rps']} req/s unless set); "
        f"B ({QUIET}): short prompts at {options['quiet_rate']} req/s (Poisson); {options['output_tokens']} "
        f"output tokens each. {options['rounds']} rounds of each arm, interleaved: B's arrivals over "
        f"{options['segment_s']:g} s, A's load until B's last answer.",
        "",
        "| arm | s | B requests (ok) | B TTFT P50 s | B TTFT P95 s | A goodput req/s | A prefill tok/s "
        "| prefill share A / B | A statuses |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        row = report["arms"][arm]
        share = row["prefill_share"]
        statuses = ", ".join(f"{status} {count}" for status, count in row["noisy_statuses"].items()) or "-"
        lines.append(
            f"| {arm} | {row['seconds']} | {row['quiet_requests']} ({row['quiet_ok']}) | {_cell(row['quiet_ttft_s']['p50'])} "
            f"| {_cell(row['quiet_ttft_s']['p95'])} | {row['noisy_goodput_rps']} "
            f"| {row['noisy_prefill_tokens_per_s']} | {_cell(share[NOISY])} / {_cell(share[QUIET])} | {statuses} |"
        )
    ratios, bars = report["ratios"], report["bars"]
    lines += [
        "",
        f"- B's TTFT P95, fair queuing vs alone: **{_cell(ratios['quiet_p95_fair_vs_alone'])}x** "
        f"(90% interval {_cell(ratios['quiet_p95_fair_vs_alone_interval'])}; bar <= {QUIET_P95_BAR}: "
        f"{_cell(bars['quiet_p95_within_1_5x_alone'])})",
        f"- B's TTFT P95, first come first served vs alone: **{_cell(ratios['quiet_p95_fifo_vs_alone'])}x**",
        f"- A's goodput, fair queuing vs off: **{_cell(ratios['noisy_goodput_fair_vs_fifo'])}** "
        f"(bar >= {NOISY_GOODPUT_BAR}: {_cell(bars['noisy_keeps_90pct_goodput'])})",
    ]
    if report.get("command"):
        lines += ["", f"Command: `{report['command']}`"]
    return "\n".join(lines) + "\n"
