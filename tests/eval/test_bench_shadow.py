"""`ctxgate bench shadow`'s report: the two cost bars (TTFT P95 and goodput, shadowing on against off),
the shadow counters' accounting, the verdict and the markdown; and the command end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ctxgate.eval.bench_shadow import ShadowBenchOptions
from ctxgate.eval.shadow_cost_report import (
    MAX_GOODPUT_DECREASE,
    MAX_TTFT_P95_INCREASE,
    answered,
    cost_checks,
    drop_accounting,
    render_markdown,
    verdict,
)
from ctxgate.eval.shadow_setup import ShadowCounts
from ctxgate.eval.slo_report import SloSample
from tests.eval.test_bench_slo import REPO_ROOT, town_dataset

SLO_S = 1.0


def _arm(arm: str, ttfts: list[float | None], abandoned: int = 0) -> list[SloSample]:
    samples = [
        SloSample(arm, 0.6, 0, index, f"q{index}", ttft, error=None if ttft is not None else "HTTP 503")
        for index, ttft in enumerate(ttfts)
    ]
    samples += [
        SloSample(arm, 0.6, 0, len(ttfts) + index, f"a{index}", None, abandoned=True, error="abandoned")
        for index in range(abandoned)
    ]
    return samples


def _checks(off: list[SloSample], on: list[SloSample]) -> dict[str, dict]:
    level = cost_checks(off, on, 0.6, SLO_S, give_up_s=4.0)
    return {("ttft" if "TTFT" in check["check"] else "goodput"): check for check in level["checks"]}


def test_shadowing_that_leaves_the_live_requests_alone_meets_both_bars():
    off = _arm("rag-default", [100.0 * i + 50 for i in range(20)])
    on = _arm("rag-default-shadow", [100.0 * i + 51 for i in range(20)])  # 1 ms later each
    checks = _checks(off, on)
    assert checks["ttft"]["on"] - checks["ttft"]["off"] == pytest.approx(1.0)
    assert 0 < checks["ttft"]["change"] <= MAX_TTFT_P95_INCREASE and checks["ttft"]["met"] is True
    assert (
        checks["goodput"]["change"] == 0.0 and checks["goodput"]["met"] is True
    )  # 10 of 20 within 1 s in both
    low, high = checks["ttft"]["ratio_interval"]
    assert low <= 1.0 <= high


def test_a_slower_tail_or_a_lost_request_fails_its_bar():
    off = _arm("rag-default", [100.0] * 20)
    on = _arm("rag-default-shadow", [100.0] * 18 + [2000.0, 2000.0])  # the tail pays: P95 x ~20
    checks = _checks(off, on)
    assert checks["ttft"]["change"] > 1 and checks["ttft"]["met"] is False
    assert checks["goodput"]["change"] == pytest.approx(-0.1) and checks["goodput"]["met"] is False
    assert checks["goodput"]["bar"] == -MAX_GOODPUT_DECREASE
    # A failed request misses the objective as one that was too slow does.
    checks = _checks(_arm("a", [100.0] * 50), _arm("b", [100.0] * 49 + [None]))
    assert checks["goodput"]["change"] == pytest.approx(-0.02) and checks["goodput"]["met"] is True
    checks = _checks(_arm("a", [100.0] * 20), _arm("b", [None] * 20))
    assert checks["ttft"]["met"] is None  # no TTFT to compare: undecided, not passed


def test_abandoned_requests_count_at_the_give_up_time_and_are_not_answered():
    on = _arm("rag-default-shadow", [100.0] * 18, abandoned=2)
    checks = _checks(_arm("rag-default", [100.0] * 20), on)
    assert checks["ttft"]["on"] == pytest.approx(4000.0)  # P95 reaches the give-up time
    assert checks["ttft"]["lower_bound"] is True and checks["ttft"]["met"] is None  # a bound, not a change
    assert answered(on) == 18 and answered(_arm("x", [1.0, None])) == 1


def test_the_counters_explain_the_arm_when_every_draw_is_compared_or_dropped():
    counts = ShadowCounts(sampled=10, comparisons=3, dropped={"busy": 6, "timeout": 1})
    drops = drop_accounting(counts, answered_requests=48, sample_rate=0.2)
    assert drops["explained"] is True and drops["unexplained"] == 0
    assert drops["expected_sampled"] == 9.6 and drops["dropped"] == 7
    assert drops["dropped_by_reason"] == {"busy": 6, "timeout": 1}
    running = drop_accounting(ShadowCounts(sampled=10, comparisons=3, dropped={"busy": 6}), 48, 0.2)
    assert running["explained"] is False and running["unexplained"] == 1
    too_many = drop_accounting(ShadowCounts(sampled=5, comparisons=5), answered_requests=4, sample_rate=1)
    assert too_many["explained"] is False  # drawn more than were answered: not this arm's


def _report(met_ttft: bool | None, explained: bool) -> dict:
    check = {
        "check": "live TTFT P95 with shadowing <= 1.05 x without",
        "off": 1000.0,
        "on": 1020.0,
        "change": 0.02,
        "bar": 0.05,
        "ratio_interval": [0.97, 1.08],
        "met": met_ttft,
    }
    goodput = check | {"check": "live goodput with shadowing >= 0.98 x without", "off": 0.5, "on": 0.5}
    goodput |= {"change": 0.0, "bar": -0.02, "met": True}
    drops = drop_accounting(ShadowCounts(sampled=9, comparisons=2, dropped={"busy": 7}), 48, 0.2)
    drops["explained"] = explained
    rates = {"0.6": {"checks": [check, goodput], "drops": drops}}
    return {
        "command": "ctxgate bench shadow",
        "policy": "rag-default",
        "sample_rate": 0.2,
        "arms": ["rag-default", "rag-default-shadow"],
        "chunk_size": 8,
        "requests_per_arm": 48,
        "slo_s": 2.5,
        "wall_s": 400.0,
        "others_cpu_frac_mean": 0.1,
        "rates": rates,
        "acceptance_met": verdict(rates),
    }


def test_verdict_and_markdown_state_both_changes_the_bars_and_the_drops():
    report = _report(True, True)
    assert report["acceptance_met"] is True
    markdown = render_markdown(report)
    assert (
        "| live TTFT P95 with shadowing <= 1.05 x without | 1000.0 | 1020.0 | +2.0% | [0.970, 1.080] | met |"
        in markdown
    )
    assert "TTFT P95 change <= +5%, goodput change >= -2%" in markdown
    assert "9 drawn (expected 9.6 at 0.2), 2 compared, 7 dropped (busy 7); unexplained 0: met" in markdown
    assert markdown.rstrip().endswith("All checks met.")
    assert verdict(_report(False, True)["rates"]) is False
    assert verdict(_report(True, False)["rates"]) is False  # unexplained drops fail the run too
    assert verdict(_report(None, True)["rates"]) is None


def test_the_two_arms_are_the_policy_and_its_shadowed_twin_only():
    options = ShadowBenchOptions(policy="rag-fast", sample_rate=0.2)
    assert options.slo_options().arms == ["rag-fast", "rag-fast-shadow"]
    assert options.rates == [0.6]  # `ctxgate bench slo`'s knee


@pytest.mark.slow
def test_bench_shadow_command_reports_both_deltas_and_accounts_for_every_draw(tmp_path):
    out = tmp_path / "shadow"
    command = [
        sys.executable,
        "-m",
        "ctxgate",
        "bench",
        "shadow",
        "--input",
        str(town_dataset(tmp_path / "t.jsonl")),
    ]
    command += [
        "--requests",
        "3",
        "--chunk-size",
        "3",
        "--rates",
        "2",
        "--sample-rate",
        "1",
        "--output-tokens",
        "4",
    ]
    command += ["--give-up-s", "600", "--no-progress", "--out", str(out)]  # a busy machine is slow
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "bench_shadow.json").read_text())
    assert report["arms"] == ["rag-default", "rag-default-shadow"] and report["shadow"] == {
        "sample_rate": 1.0
    }
    level = report["rates"]["2"]
    assert level["off"]["requests"] == 3 and level["on"]["requests"] == 3
    assert [check["bar"] for check in level["checks"]] == [MAX_TTFT_P95_INCREASE, -MAX_GOODPUT_DECREASE]
    drops = level["drops"]
    # rag-default leaves the town facts (about 200 tokens) whole: every draw is dropped, and says why.
    assert drops["sampled"] == drops["answered"] == 3 and drops["explained"] is True
    assert drops["compared"] + drops["dropped"] == 3
    assert "## 2 requests/s" in (out / "bench_shadow.md").read_text()
