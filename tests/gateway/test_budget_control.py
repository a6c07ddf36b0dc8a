"""The adaptive budget decision as a pure function (engine state + candidates -> budget), its damping,
and the controller's bookkeeping over a fixed engine reading."""

from __future__ import annotations

import time

import pytest

from ctxgate.gateway.budget_control import (
    CEILING,
    FLOOR_MISSES_SLO,
    KV_PRESSURE,
    NO_ESTIMATE,
    RISE_LIMITED,
    SLO,
    BudgetController,
    Decision,
    EngineLoad,
    Estimates,
    Outcome,
    candidate_budgets,
    choose_budget,
    damp,
    predicted_ttft_s,
)
from ctxgate.gateway.engine_load import EngineReading
from ctxgate.policies.schema import AdaptivePolicy

CANDIDATES = (160, 240, 320, 400, 480, 560, 640, 720, 800, 880, 960, 1040, 1120, 1200)
SPEED = 1000.0  # prefill tokens/s


def load(waiting: int = 0, speed: float | None = SPEED, kv: float = 0.1, running: int = 0) -> EngineLoad:
    return EngineLoad(waiting_tokens=waiting, running=running, kv_usage=kv, prefill_tokens_per_s=speed)


@pytest.mark.parametrize(
    ("engine", "estimates", "target_s", "budget", "reason"),
    [
        # Idle: the ceiling's prefill (1.2 s) fits a 1.75 s target.
        (load(), Estimates(), 1.75, 1200, CEILING),
        # 1000 tokens queued: 1000 + b <= 1750 -> b <= 750 -> 720.
        (load(waiting=1000), Estimates(), 1.75, 720, SLO),
        # Compression time and prompt overhead come off the room: (1.75 - 0.25) * 1000 - 500 - 100 = 900 -> 880.
        (load(waiting=500), Estimates(compression_s=0.25, overhead_tokens=100), 1.75, 880, SLO),
        # Measured TTFT ran twice the prediction: the room halves, 875 - 500 = 375 -> 320.
        (load(waiting=500), Estimates(calibration=2.0), 1.75, 320, SLO),
        # A long queue: even the floor misses; the floor stands (admission decides, no deeper cut).
        (load(waiting=5000), Estimates(), 1.75, 160, FLOOR_MISSES_SLO),
        # Exactly on a candidate: 1750 - 1350 = 400 fits.
        (load(waiting=1350), Estimates(), 1.75, 400, SLO),
        # Twice the speed: the queue drains twice as fast.
        (load(waiting=2000, speed=2000.0), Estimates(), 1.75, 1200, CEILING),
        # KV cache nearly full: the floor whatever the queue.
        (load(kv=0.97), Estimates(), 1.75, 160, KV_PRESSURE),
        # Nothing measured yet: the policy's own budget (560).
        (load(speed=None), Estimates(), 1.75, 560, NO_ESTIMATE),
    ],
)
def test_choose_budget_table(engine, estimates, target_s, budget, reason):
    decision = choose_budget(engine, estimates, CANDIDATES, target_s, max_kv_usage=0.95, fallback=560)
    assert (decision.budget, decision.reason) == (budget, reason)
    predicted = predicted_ttft_s(engine, estimates, decision.budget)
    assert decision.predicted_ttft_s == predicted
    if reason in (CEILING, SLO):
        assert predicted is not None and predicted <= target_s + 1e-9
        larger = [c for c in CANDIDATES if c > decision.budget]
        if larger:  # the largest that keeps the target: the next one up would not
            assert predicted_ttft_s(engine, estimates, larger[0]) > target_s


def test_budget_never_rises_as_the_queue_grows():
    budgets = [
        choose_budget(load(waiting=w), Estimates(), CANDIDATES, 1.75, 0.95, 560).budget
        for w in range(0, 6000, 50)
    ]
    assert budgets == sorted(budgets, reverse=True)
    assert budgets[0] == 1200 and budgets[-1] == 160


def test_no_estimate_fallback_is_clamped_to_the_range():
    assert choose_budget(load(speed=None), Estimates(), CANDIDATES, 1.0, 0.95, fallback=50).budget == 160
    assert choose_budget(load(speed=0.0), Estimates(), CANDIDATES, 1.0, 0.95, fallback=9000).budget == 1200


@pytest.mark.parametrize(
    ("floor", "ceiling", "step", "expected"),
    [(160, 1200, 80, CANDIDATES), (100, 100, 50, (100,)), (0, 250, 100, (0, 100, 200, 250))],
)
def test_candidate_budgets(floor, ceiling, step, expected):
    assert (
        candidate_budgets(AdaptivePolicy(floor_tokens=floor, ceiling_tokens=ceiling, step_tokens=step))
        == expected
    )


@pytest.mark.parametrize(
    ("target", "last", "since_rise", "budget", "reason", "rose"),
    [
        (Decision(320, SLO, 1.0), 800, 0.0, 320, SLO, False),  # falls at once
        (Decision(1200, CEILING, 1.0), None, 0.0, 1200, CEILING, False),  # first decision: as chosen
        (Decision(1200, CEILING, 1.0), 400, 0.1, 400, RISE_LIMITED, False),  # too soon to rise
        (Decision(1200, CEILING, 1.0), 400, 0.6, 480, RISE_LIMITED, True),  # one step up
        (Decision(480, SLO, 1.0), 400, 0.6, 480, SLO, True),  # the step reaches the target
        (Decision(400, SLO, 1.0), 400, 9.0, 400, SLO, False),  # unchanged
        (Decision(1200, CEILING, 1.0), 400, 1.6, 640, RISE_LIMITED, True),  # three intervals: three steps
        (Decision(720, SLO, 1.0), 400, 9.0, 720, SLO, True),  # a long quiet stretch: up to the target
    ],
)
def test_damping(target, last, since_rise, budget, reason, rose):
    decision, did_rise = damp(
        target, last, last_rise_at=10.0, now=10.0 + since_rise, candidates=CANDIDATES, relax_interval_s=0.5
    )
    assert (decision.budget, decision.reason, did_rise) == (budget, reason, rose)


class FixedReading:
    """An engine reading that the test sets (the controller's seam, `LoadReader`)."""

    def __init__(self, reading: EngineReading):
        self.reading = reading

    def read(self) -> EngineReading:
        return self.reading


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


POLICY = AdaptivePolicy(
    enabled=True,
    ttft_slo_s=2.5,
    headroom=0.7,
    floor_tokens=160,
    ceiling_tokens=1200,
    step_tokens=80,
    relax_interval_s=0.5,
)


def test_a_burst_sees_itself_and_tightens_then_relaxes_step_by_step():
    reader = FixedReading(EngineReading(prefill_tokens_per_s=SPEED))
    clock = Clock()
    controller = BudgetController(reader, clock=clock)
    burst = [controller.decide(f"r{i}", "p", POLICY, 560) for i in range(6)]
    budgets = [d.budget for d in burst]
    assert budgets[0] == 1200 and budgets == sorted(budgets, reverse=True) and budgets[-1] == 160
    assert burst[-1].reason == FLOOR_MISSES_SLO
    for i in range(6):  # the burst is prefilled: nothing queued any more
        controller.first_token(f"r{i}")
    assert controller.load().waiting_tokens == 0
    later = [controller.decide("x", "p", POLICY, 560).budget]
    for _ in range(4):
        clock.now += 0.6
        controller.forget("x")
        later.append(controller.decide("x", "p", POLICY, 560).budget)
    assert later == [160, 240, 320, 400, 480]  # one step per relax interval, no jump back to the ceiling


def test_after_a_quiet_stretch_the_budget_rises_by_the_intervals_elapsed_not_one_step_per_request():
    reader = FixedReading(EngineReading(waiting_tokens=100_000, prefill_tokens_per_s=SPEED))
    clock = Clock()
    controller = BudgetController(reader, clock=clock)
    assert controller.decide("busy", "p", POLICY, 560).budget == 160
    controller.forget("busy")
    reader.reading = EngineReading(prefill_tokens_per_s=SPEED)  # the queue drained
    clock.now += 0.2
    assert (
        controller.decide("soon", "p", POLICY, 560).reason == RISE_LIMITED
    )  # within one interval of the fall
    controller.forget("soon")
    clock.now += 2.0  # 2.2 s since the fall: four intervals, four steps
    assert controller.decide("later", "p", POLICY, 560).budget == 480


def test_engine_queue_and_own_ledger_are_not_added_twice():
    reader = FixedReading(
        EngineReading(waiting_tokens=3000, running=4, kv_usage=0.5, prefill_tokens_per_s=SPEED)
    )
    controller = BudgetController(reader)
    controller.decide("a", "p", POLICY, 560)
    assert controller.load().waiting_tokens == 3000


def test_outcomes_feed_the_estimates():
    controller = BudgetController(FixedReading(EngineReading()))  # an upstream: no engine state
    assert controller.decide("a", "p", POLICY, 560).reason == NO_ESTIMATE
    controller.observe("a", 560, Outcome(ttft_s=2.0, compression_s=0.3, prompt_tokens=700, prefill_ms=700.0))
    estimates = controller.estimates()
    assert estimates.compression_s == pytest.approx(0.3)
    assert estimates.overhead_tokens == 140
    assert controller.load().prefill_tokens_per_s == pytest.approx(1000.0)
    before = controller.load()
    decision = controller.decide("b", "p", POLICY, 560)
    assert decision.reason in (CEILING, SLO, RISE_LIMITED)
    assert decision.predicted_ttft_s == predicted_ttft_s(before, estimates, decision.budget)
    controller.observe(
        "b",
        decision.budget,
        Outcome(
            ttft_s=4 * decision.predicted_ttft_s,
            compression_s=0.3,
            prompt_tokens=decision.budget + 140,
            prefill_ms=1000.0,
        ),
    )
    assert controller.estimates().calibration > 1.0  # TTFT ran over the prediction: predictions grow


def test_a_decision_takes_microseconds():
    controller = BudgetController(FixedReading(EngineReading(waiting_tokens=900, prefill_tokens_per_s=SPEED)))
    count = 2000
    started = time.perf_counter()
    for _ in range(count):
        controller.decide("r", "p", POLICY, 560)
        controller.forget("r")
    per_decision_us = (time.perf_counter() - started) / count * 1e6
    assert per_decision_us < 200, per_decision_us
