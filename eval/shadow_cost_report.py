"""`ctxgate bench shadow`'s figures: what shadowing costs live requests (TTFT P95 and goodput with
shadowing on against off, on the same arrival schedules), and whether the shadow counters account
for every request it drew and did not compare. Pure functions over samples and counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ctxgate.eval.shadow_setup import ShadowCounts
from ctxgate.eval.slo_report import SloSample, paired_goodput_ratio_interval, summarize_arm
from ctxgate.eval.stats import p95_ratio_interval

MAX_TTFT_P95_INCREASE = 0.05  # shadowing may raise the live TTFT P95 by at most 5%
MAX_GOODPUT_DECREASE = 0.02  # and lower the live goodput by at most 2%


def _ttfts(samples: Sequence[SloSample], give_up_s: float | None) -> list[float]:
    """TTFTs in ms, an abandoned request at the give-up time (as the P95 counts it)."""
    values = [s.ttft_ms for s in samples if s.error is None and s.ttft_ms is not None]
    return values + [give_up_s * 1000 for s in samples if s.abandoned and give_up_s]


def _change(on: float | None, off: float | None) -> float | None:
    """on relative to off, as a signed fraction (+0.03: 3% higher)."""
    if on is None or not off:
        return None
    return round(on / off - 1, 4)


def cost_checks(
    off: Sequence[SloSample], on: Sequence[SloSample], rate: float, slo_s: float, give_up_s: float | None
) -> dict[str, Any]:
    """The two arms' summaries and the issue's two bars at one rate. `met` is None where the run
    cannot decide (an arm without a TTFT or whose P95 is an abandoned request's, or an arm without
    any request within the objective)."""
    off_row = summarize_arm(off, rate, slo_s, give_up_s)
    on_row = summarize_arm(on, rate, slo_s, give_up_s)
    ttft_change = _change(on_row["ttft_ms"]["p95"], off_row["ttft_ms"]["p95"])
    # A P95 that reaches an abandoned request is a lower bound: no change can be read from it.
    bounded = on_row["ttft_ms"]["p95_lower_bound"] or off_row["ttft_ms"]["p95_lower_bound"]
    goodput_change = _change(on_row["goodput"], off_row["goodput"])
    ratio = p95_ratio_interval(_ttfts(on, give_up_s), _ttfts(off, give_up_s))
    goodput_ratio = paired_goodput_ratio_interval(on, off, slo_s)
    checks = [
        {
            "check": f"live TTFT P95 with shadowing <= {1 + MAX_TTFT_P95_INCREASE:g} x without",
            "off": off_row["ttft_ms"]["p95"],
            "on": on_row["ttft_ms"]["p95"],
            "change": ttft_change,
            "bar": MAX_TTFT_P95_INCREASE,
            "ratio_interval": ratio,
            "lower_bound": bounded,
            "met": None if ttft_change is None or bounded else ttft_change <= MAX_TTFT_P95_INCREASE,
        },
        {
            "check": f"live goodput with shadowing >= {1 - MAX_GOODPUT_DECREASE:g} x without",
            "off": off_row["goodput"],
            "on": on_row["goodput"],
            "change": goodput_change,
            "bar": -MAX_GOODPUT_DECREASE,
            "ratio_interval": goodput_ratio,
            "met": None if goodput_change is None else goodput_change >= -MAX_GOODPUT_DECREASE,
        },
    ]
    return {"off": off_row, "on": on_row, "checks": checks}


def answered(samples: Sequence[SloSample]) -> int:
    """Requests answered in full: the only ones a shadow draw sees."""
    return sum(1 for s in samples if s.error is None and not s.abandoned)


def drop_accounting(counts: ShadowCounts, answered_requests: int, sample_rate: float) -> dict[str, Any]:
    """Whether the counters explain the shadowed arm: every drawn request compared or dropped with a
    reason (none left running once the arm settled), and no more drawn than were answered."""
    dropped = sum(counts.dropped.values())
    return {
        "answered": answered_requests,
        "sample_rate": sample_rate,
        "expected_sampled": round(answered_requests * sample_rate, 1),
        "sampled": counts.sampled,
        "compared": counts.comparisons,
        "dropped": dropped,
        "dropped_by_reason": dict(counts.dropped),
        "unexplained": counts.sampled - counts.comparisons - dropped,
        "explained": counts.sampled == counts.comparisons + dropped and counts.sampled <= answered_requests,
    }


def verdict(rates: dict[str, Any]) -> bool | None:
    flags = [check["met"] for level in rates.values() for check in level["checks"]]
    flags += [level["drops"]["explained"] for level in rates.values()]
    return None if not flags or None in flags else all(flags)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.1f}%"


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _interval(interval: Sequence[float] | None) -> str:
    return "–" if not interval else f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def _met(flag: bool | None) -> str:
    return {True: "met", False: "NOT met", None: "undecided"}[flag]


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Shadow cost at the knee: {report['policy']} with `shadow: {{sample_rate: {report['sample_rate']:g}}}` "
        "against shadowing off",
        "",
        f"- Command: `{report['command']}`",
        f"- Arms: `{report['arms'][0]}` (off) and `{report['arms'][1]}` (the same policy shadowing), interleaved "
        f"in chunks of {report['chunk_size']} on the same Poisson schedules and questions, {report['requests_per_arm']} "
        f"requests per arm and rate; one gateway; the shadowed arm's shadow work settles before the next arm",
        f"- Objective: TTFT <= {report['slo_s']:g} s (client-side, first streamed token); goodput = offered rate "
        "x share within it",
        f"- Bars: TTFT P95 change <= +{100 * MAX_TTFT_P95_INCREASE:g}%, goodput change >= "
        f"-{100 * MAX_GOODPUT_DECREASE:g}%, every drawn request compared or dropped with a reason; "
        "intervals: 90% bootstrap of on/off",
        f"- Wall time {report['wall_s']:g} s; other processes took {_num(report['others_cpu_frac_mean'])} of the "
        "machine's CPU on average (a busy machine blurs a 5% bar)",
        "",
    ]
    for rate, level in report["rates"].items():
        lines += [
            f"## {rate} requests/s",
            "",
            "| check | off | on | change | on/off interval | |",
            "|---|---|---|---|---|---|",
        ]
        for check in level["checks"]:
            lines.append(
                f"| {check['check']} | {_num(check['off'], 1 if 'TTFT' in check['check'] else 4)} | "
                f"{_num(check['on'], 1 if 'TTFT' in check['check'] else 4)} | {_pct(check['change'])} | "
                f"{_interval(check['ratio_interval'])} | {_met(check['met'])} |"
            )
        drops = level["drops"]
        reasons = (
            ", ".join(f"{reason} {count}" for reason, count in drops["dropped_by_reason"].items()) or "none"
        )
        lines += [
            "",
            f"Shadow counters: {drops['answered']} live requests answered, {drops['sampled']} drawn "
            f"(expected {drops['expected_sampled']:g} at {drops['sample_rate']:g}), {drops['compared']} compared, "
            f"{drops['dropped']} dropped ({reasons}); unexplained {drops['unexplained']}: {_met(drops['explained'])}.",
            "",
        ]
    overall = report["acceptance_met"]
    lines.append(
        "All checks met."
        if overall
        else ("A check is NOT met." if overall is False else "Undecided: an arm lacked data.")
    )
    return "\n".join(lines) + "\n"
