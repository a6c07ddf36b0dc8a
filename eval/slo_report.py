"""`ctxgate bench slo`'s figures: goodput under a TTFT objective with bootstrap intervals, the
issue's acceptance checks, the markdown report and the plot. Pure functions over samples."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctxgate.eval.stats import interval_of, percentile

CONFIDENCE = 0.9  # of every bootstrap interval in the report
RESAMPLES = 2000
ABOVE_KNEE_GAIN = 1.3  # adaptive goodput over rag-default's, above the knee
BASELINE = "rag-default"  # the policy the gain and retention bars are measured against


@dataclass
class SloSample:
    """One request as the client saw it, plus what the gateway reported in usage."""

    arm: str
    rate: float
    chunk: int
    position: int  # place in its chunk's arrival schedule: the same request of every arm shares it
    question_id: str
    ttft_ms: float | None  # None: the request failed (it counts as missing the objective)
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    original_prompt_tokens: int | None = None
    budget_tokens: int | None = None  # adaptive arm: the documents budget the controller chose
    budget_reason: str | None = None
    gateway_ttft_s: float | None = None  # adaptive arm: the gateway's own TTFT (usage.ctxgate.budget)
    answer_retained: bool | None = None  # gold answer in the prompt the model saw; None: not scored
    error: str | None = None
    abandoned: bool = False  # no first token within the give-up time: the client closed the stream

    def met(self, slo_s: float) -> bool:
        return self.error is None and self.ttft_ms is not None and self.ttft_ms <= slo_s * 1000


# ---------------------------------------------------------------------------- goodput
def goodput(samples: Sequence[SloSample], rate: float, slo_s: float) -> float:
    """Requests/s that met the objective: the offered rate times the share that met it (every arm
    of a rate is offered the same schedule, so this compares arms exactly and never exceeds the rate)."""
    if not samples:
        return 0.0
    return rate * sum(s.met(slo_s) for s in samples) / len(samples)


def _resampled_indices(size: int, resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, size, size=(resamples, size))


def goodput_interval(
    samples: Sequence[SloSample],
    rate: float,
    slo_s: float,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> list[float] | None:
    """A percentile-bootstrap interval of `goodput` (requests resampled)."""
    if not samples:
        return None
    met = np.asarray([s.met(slo_s) for s in samples], dtype=float)
    shares = met[_resampled_indices(met.size, resamples, seed)].mean(axis=1)
    low, high = interval_of((rate * shares).tolist(), confidence)
    return [round(low, 4), round(high, 4)]


def paired(first: Sequence[SloSample], second: Sequence[SloSample]) -> list[tuple[SloSample, SloSample]]:
    """The requests both arms were sent at the same place of the same chunk (same question, same time)."""
    by_place = {(s.chunk, s.position): s for s in second}
    return [(s, by_place[(s.chunk, s.position)]) for s in first if (s.chunk, s.position) in by_place]


def paired_goodput_difference(
    candidate: Sequence[SloSample],
    baseline: Sequence[SloSample],
    rate: float,
    slo_s: float,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> dict[str, Any]:
    """candidate - baseline goodput over the places both arms served, with a paired bootstrap
    interval (places resampled: one arrival schedule and question drives both arms' outcomes)."""
    pairs = paired(candidate, baseline)
    if not pairs:
        return {"value": None, "interval": None, "n": 0}
    differences = np.asarray([float(a.met(slo_s)) - float(b.met(slo_s)) for a, b in pairs])
    means = differences[_resampled_indices(differences.size, resamples, seed)].mean(axis=1)
    low, high = interval_of((rate * means).tolist(), confidence)
    return {
        "value": round(rate * float(differences.mean()), 4),
        "interval": [round(low, 4), round(high, 4)],
        "n": len(pairs),
    }


def paired_goodput_ratio_interval(
    candidate: Sequence[SloSample],
    baseline: Sequence[SloSample],
    slo_s: float,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> list[float] | None:
    """A paired bootstrap interval of candidate / baseline goodput (resamples where the baseline met
    nothing are left out: the ratio is undefined there)."""
    pairs = paired(candidate, baseline)
    if not pairs:
        return None
    ours = np.asarray([float(a.met(slo_s)) for a, _ in pairs])
    theirs = np.asarray([float(b.met(slo_s)) for _, b in pairs])
    indices = _resampled_indices(len(pairs), resamples, seed)
    numerators, denominators = ours[indices].sum(axis=1), theirs[indices].sum(axis=1)
    ratios = (numerators[denominators > 0] / denominators[denominators > 0]).tolist()
    if len(ratios) < resamples / 2:  # the baseline met nothing in most resamples: no interval to give
        return None
    low, high = interval_of(ratios, confidence)
    return [round(low, 3), round(high, 3)]


# ---------------------------------------------------------------------------- per arm
def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def retention(samples: Sequence[SloSample]) -> dict[str, Any]:
    """Share of scored requests whose prompt kept a gold answer, with a bootstrap interval."""
    scored = np.asarray([float(s.answer_retained) for s in samples if s.answer_retained is not None])
    if scored.size == 0:
        return {"value": None, "interval": None, "n": 0}
    means = scored[_resampled_indices(scored.size, RESAMPLES, 1)].mean(axis=1)
    low, high = interval_of(means.tolist(), CONFIDENCE)
    return {
        "value": round(float(scored.mean()), 4),
        "interval": [round(low, 4), round(high, 4)],
        "n": int(scored.size),
    }


def compression_ratio(samples: Sequence[SloSample]) -> float | None:
    """Original prompt tokens over the tokens sent, summed over the arm's requests."""
    pairs = [
        (s.original_prompt_tokens, s.prompt_tokens)
        for s in samples
        if not s.error and s.original_prompt_tokens and s.prompt_tokens
    ]
    sent = sum(p for _, p in pairs)
    return round(sum(o for o, _ in pairs) / sent, 3) if sent else None


def ttft_percentiles(samples: Sequence[SloSample], give_up_s: float | None) -> dict[str, Any]:
    """TTFT P50 / P95 ms; an abandoned request counts at the give-up time, so a percentile that
    reaches one is a lower bound (`*_lower_bound`), not a measurement."""
    values = sorted(
        [(s.ttft_ms, False) for s in samples if s.error is None and s.ttft_ms is not None]
        + [(give_up_s * 1000, True) for s in samples if s.abandoned and give_up_s]
    )
    out: dict[str, Any] = {}
    for point in (50, 95):
        if not values:
            out[f"p{point}"], out[f"p{point}_lower_bound"] = None, False
            continue
        rank = (len(values) - 1) * point / 100
        out[f"p{point}"] = round(percentile([v for v, _ in values], point), 1)
        out[f"p{point}_lower_bound"] = values[min(int(rank) + 1, len(values) - 1)][1]
    return out


def summarize_arm(
    samples: Sequence[SloSample], rate: float, slo_s: float, give_up_s: float | None = None
) -> dict[str, Any]:
    budgets = [s.budget_tokens for s in samples if s.budget_tokens is not None]
    reasons: dict[str, int] = {}
    for s in samples:
        if s.budget_reason:
            reasons[s.budget_reason] = reasons.get(s.budget_reason, 0) + 1
    return {
        "requests": len(samples),
        "errors": sum(1 for s in samples if s.error and not s.abandoned),
        "abandoned": sum(1 for s in samples if s.abandoned),
        "goodput": round(goodput(samples, rate, slo_s), 4),
        "goodput_interval": goodput_interval(samples, rate, slo_s),
        "slo_attainment": round(sum(s.met(slo_s) for s in samples) / len(samples), 4) if samples else None,
        "ttft_ms": ttft_percentiles(samples, give_up_s),
        "prompt_tokens_mean": _mean(
            [float(s.prompt_tokens) for s in samples if s.prompt_tokens and not s.error]
        ),
        "compression_ratio": compression_ratio(samples),
        "answer_retention": retention(samples),
        "budget_tokens_mean": _mean([float(b) for b in budgets]),
        "budget_reasons": reasons,
    }


def summarize_rate(
    samples: Sequence[SloSample],
    rate: float,
    slo_s: float,
    arms: Sequence[str],
    give_up_s: float | None = None,
) -> dict[str, Any]:
    return {arm: summarize_arm([s for s in samples if s.arm == arm], rate, slo_s, give_up_s) for arm in arms}


# ---------------------------------------------------------------------------- acceptance
def knee_side(rate: float, knee: float) -> str:
    if math.isclose(rate, knee, rel_tol=1e-9):
        return "at"
    return "below" if rate < knee else "above"


def acceptance(
    samples: Sequence[SloSample],
    rate: float,
    slo_s: float,
    summary: dict[str, Any],
    adaptive: str,
    fixed: Sequence[str],
    knee: float,
) -> list[dict[str, Any]]:
    """The issue's bars at one rate. `met` is None where the run cannot decide (an arm missing)."""

    def arm_samples(arm: str) -> list[SloSample]:
        return [s for s in samples if s.arm == arm]

    checks: list[dict[str, Any]] = []
    present = [arm for arm in fixed if arm in summary and summary[arm]["requests"]]
    if adaptive in summary and present:
        best = max(present, key=lambda arm: summary[arm]["goodput"])
        difference = paired_goodput_difference(arm_samples(adaptive), arm_samples(best), rate, slo_s)
        low = difference["interval"][0] if difference["interval"] else None
        high = difference["interval"][1] if difference["interval"] else None
        checks.append(
            {
                "check": f"adaptive goodput >= best fixed ({best}) within the interval",
                "value": summary[adaptive]["goodput"],
                "bar": summary[best]["goodput"],
                "difference": difference["value"],
                "interval": difference["interval"],
                # Not worse than the best fixed policy beyond this run's noise: the paired interval of
                # (adaptive - best) reaches zero or above.
                "met": None if high is None else high >= 0,
                "clearly_better": None if low is None else low > 0,
            }
        )
    side = knee_side(rate, knee)
    if side == "above" and adaptive in summary and BASELINE in summary:
        ours, theirs = summary[adaptive]["goodput"], summary[BASELINE]["goodput"]
        gain = round(ours / theirs, 3) if theirs else (math.inf if ours else None)
        checks.append(
            {
                "check": f"adaptive goodput >= {ABOVE_KNEE_GAIN}x {BASELINE} (above the knee)",
                "value": None if gain is None or math.isinf(gain) else gain,
                "bar": ABOVE_KNEE_GAIN,
                **({"note": f"{BASELINE} met the objective for no request"} if not theirs else {}),
                "interval": paired_goodput_ratio_interval(
                    arm_samples(adaptive), arm_samples(BASELINE), slo_s
                ),
                "met": None if gain is None else gain >= ABOVE_KNEE_GAIN,
            }
        )
    if side == "below" and adaptive in summary and BASELINE in summary:
        ours, theirs = summary[adaptive]["answer_retention"], summary[BASELINE]["answer_retention"]
        met = None if ours["value"] is None or theirs["value"] is None else ours["value"] >= theirs["value"]
        checks.append(
            {
                "check": f"adaptive answer retention >= {BASELINE}'s (below the knee)",
                "value": ours["value"],
                "bar": theirs["value"],
                "interval": ours["interval"],
                "met": met,
            }
        )
    return checks


# ---------------------------------------------------------------------------- report
def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _interval(interval: Sequence[float] | None, digits: int = 3) -> str:
    return f" [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]" if interval else ""


def _ttft(row: dict[str, Any], key: str) -> str:
    return (">" if row.get(f"{key}_lower_bound") else "") + _f(row.get(key), 0)


def _share(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# SLO benchmark: goodput under a TTFT objective, fixed budgets against budgets that follow the load",
        "",
        f"- Command: `{report['command']}`",
        f"- Dataset: `{report['dataset']}`, {report['split']} half, {report['requests_per_arm']} requests per arm "
        f"and rate ({report['output_tokens']} output tokens each, ignore_eos, streamed, a unique tag first in "
        "every prompt: no prefix-cache hits)",
        f"- Objective: TTFT <= {report['slo_s']:g} s, measured by the client from send to the first streamed "
        "token (compression included); goodput = requests/s that met it = offered rate x attainment",
        f"- Arms: {', '.join(report['arms'])}; interleaved in chunks of {report['chunk_size']}, each chunk's "
        "arrival schedule (Poisson) the same for every arm, arm order rotated per chunk; one gateway "
        "(`ctxgate serve`, built-in engine, no shared cache) for the whole run",
        f"- Knee taken at {report['knee']:g} requests/s; a request without a first token after "
        f"{report['give_up_s']:g} s is abandoned (the client closes the stream; counted as a miss, its TTFT as "
        "that time, so a percentile marked > is a lower bound)",
        f"- Others' CPU: the share of the machine other processes used while an arm ran (mean over its chunks; "
        f"whole run mean {_share(report.get('others_cpu_frac_mean'))}, max {_share(report.get('others_cpu_frac_max'))})",
        f"- CPU path: {report['cpu_path']}",
        f"- Wall time: {report['wall_s']:.0f} s",
        "",
    ]
    for rate_key, level in report["rates"].items():
        rate = float(rate_key)
        lines += [
            f"## {rate:g} requests/s ({knee_side(rate, report['knee'])} the knee)",
            "",
            "| arm | goodput req/s [90% CI] | SLO attainment | TTFT P50 / P95 ms | answer retention [90% CI] "
            "| compression ratio | prompt tok | budget mean | abandoned / errors | others' CPU |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for arm, row in level["arms"].items():
            kept = row["answer_retention"]
            lines.append(
                f"| {arm} | {_f(row['goodput'])}{_interval(row['goodput_interval'])} | {_f(row['slo_attainment'], 2)} | "
                f"{_ttft(row['ttft_ms'], 'p50')} / {_ttft(row['ttft_ms'], 'p95')} | "
                f"{_f(kept['value'], 3)}{_interval(kept['interval'])} (n={kept['n']}) | {_f(row['compression_ratio'], 2)} | "
                f"{_f(row['prompt_tokens_mean'], 0)} | {_f(row['budget_tokens_mean'], 0)} | "
                f"{row['abandoned']} / {row['errors']} | {_share(level.get('others_cpu', {}).get(arm))} |"
            )
        reasons = {arm: row["budget_reasons"] for arm, row in level["arms"].items() if row["budget_reasons"]}
        for arm, counts in reasons.items():
            lines.append("")
            lines.append(
                f"- {arm}: budget reasons " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            )
        lines += ["", "| check | value | bar | interval | met |", "| --- | --- | --- | --- | --- |"]
        for check in level["acceptance"]:
            met = "–" if check["met"] is None else ("yes" if check["met"] else "**no**")
            detail = f" (difference {_f(check['difference'])})" if check.get("difference") is not None else ""
            detail += f" ({check['note']})" if check.get("note") else ""
            lines.append(
                f"| {check['check']} | {_f(check['value'])}{detail} | {_f(check['bar'])} | "
                f"{_interval(check.get('interval')).strip() or '–'} | {met} |"
            )
        lines.append("")
    verdict = report["acceptance_met"]
    lines += [
        f"**All acceptance checks met: {'–' if verdict is None else ('yes' if verdict else 'no')}**",
        "",
        "Intervals: 90% percentile bootstrap (requests resampled; the goodput check pairs the two arms' "
        "requests by place in the schedule). A per-rate figure over a few dozen requests moves by several "
        "points from run to run on a shared two-core machine.",
        "",
    ]
    if report.get("plot"):
        lines += [f"![goodput and answer retention against arrival rate]({report['plot']})", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Goodput (with intervals, and the offered rate as the ceiling) and answer retention per arm
    against the arrival rate."""
    from ctxgate.eval.plots import _pyplot

    plt = _pyplot()
    rates = [float(key) for key in report["rates"]]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(rates, rates, color="grey", linestyle=":", label="offered rate")
    for index, arm in enumerate(report["arms"]):
        rows = [report["rates"][key]["arms"][arm] for key in report["rates"]]
        values = [row["goodput"] for row in rows]
        errors = [
            [v - (row["goodput_interval"] or [v, v])[0] for v, row in zip(values, rows, strict=True)],
            [(row["goodput_interval"] or [v, v])[1] - v for v, row in zip(values, rows, strict=True)],
        ]
        left.errorbar(rates, values, yerr=errors, marker="o", capsize=3, color=f"C{index}", label=arm)
        kept = [row["answer_retention"]["value"] for row in rows]
        right.plot(
            rates, [math.nan if v is None else v for v in kept], marker="s", color=f"C{index}", label=arm
        )
    left.set_title(f"goodput: requests/s with TTFT <= {report['slo_s']:g} s")
    right.set_title("answer retention (gold answer in the prompt)")
    for axis in (left, right):
        axis.set_xlabel("arrival rate (requests/s)")
        axis.axvline(report["knee"], color="grey", alpha=0.3)
        axis.grid(alpha=0.3)
    right.set_ylim(-0.02, 1.02)
    left.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
