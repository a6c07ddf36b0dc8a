"""`ctxgate bench fairness`: the report's figures (B's TTFT, A's goodput, prefill shares, the ratios
and bars) are computed as documented, and the command's flags reach its options."""

from __future__ import annotations

from dataclasses import asdict

from ctxgate.cli import build_parser
from ctxgate.eval.bench_fairness import NOISY, QUIET, FairnessOptions, Outcome
from ctxgate.eval.fairness_report import render_markdown, summarize


def outcome(tenant: str, arm: str, ttft: float | None, finished: float | None, tokens: int, status="ok"):
    return asdict(Outcome(tenant, arm, 0, 0.0, status, ttft, finished, tokens, 4))


def test_the_figures_ratios_and_bars():
    options = FairnessOptions(segment_s=10.0, rounds=1)
    rows = [
        outcome(QUIET, "alone", 0.2, 1.0, 20),
        outcome(QUIET, "alone", 0.4, 2.0, 20),
        outcome(QUIET, "fair", 0.3, 3.0, 20),
        outcome(QUIET, "fair", 0.5, 4.0, 20),
        outcome(QUIET, "fifo", 4.0, 9.0, 20),
        outcome(QUIET, "fifo", 8.0, 19.0, 20),
        *(outcome(NOISY, "fair", 1.0, 2.0 + index, 2500) for index in range(6)),
        outcome(NOISY, "fair", None, None, 0, status="429"),
        *(outcome(NOISY, "fifo", 1.0, 2.0 + index, 2500) for index in range(14)),
        outcome(NOISY, "fifo", None, None, 0, status="cut"),  # open at the arm's end: not goodput
    ]
    # A's load lasts until B's last answer: the fifo arm ran twice as long.
    seconds = {"alone": 10.0, "fair": 10.0, "fifo": 20.0}
    raw = {"capacity_rps": 1.0, "noisy_rate": 5.0, "arm_seconds": seconds, "outcomes": rows}
    report = summarize(raw, options)
    fair, fifo = report["arms"]["fair"], report["arms"]["fifo"]
    assert fair["quiet_ttft_s"]["p95"] == 0.49 and report["arms"]["alone"]["quiet_ttft_s"]["p95"] == 0.39
    assert (fair["noisy_goodput_rps"], fifo["noisy_goodput_rps"]) == (0.6, 0.7)
    assert fair["noisy_statuses"] == {"429": 1, "ok": 6}
    assert fifo["noisy_statuses"] == {"cut": 1, "ok": 14}
    assert fair["prefill_tokens"] == {NOISY: 15000, QUIET: 40}
    assert fifo["noisy_prefill_tokens_per_s"] == 35000 / 20
    assert fair["prefill_share"][QUIET] == round(40 / 15040, 4)
    ratios = report["ratios"]
    assert ratios["quiet_p95_fair_vs_alone"] == round(0.49 / 0.39, 3)
    assert ratios["noisy_goodput_fair_vs_fifo"] == round(0.6 / 0.7, 3)
    assert report["bars"] == {"quiet_p95_within_1_5x_alone": True, "noisy_keeps_90pct_goodput": False}
    text = render_markdown(report)
    assert "| fair | 10.0 | 2 (2) | 0.4 | 0.49 | 0.6 |" in text
    assert f"**{ratios['quiet_p95_fair_vs_alone']}x**" in text


def test_flags_reach_the_options():
    args = build_parser().parse_args(
        ["bench", "fairness", "--segment-s", "30", "--rounds", "3", "--quiet-rate", "0.5", "--quick"]
    )
    assert (args.segment_s, args.rounds, args.quiet_rate, args.quick) == (30.0, 3, 0.5, True)
    assert args.noisy_prompt_tokens == 2500 and args.overload == 5.0
