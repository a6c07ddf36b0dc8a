"""Budgets that follow the load: each request's documents budget is chosen from what the engine is
doing now, so a TTFT objective holds at high load and idle time buys longer prompts.

`choose_budget` is the decision, a pure function: predicted TTFT for a candidate budget b is

    calibration x (compression_s + (waiting_tokens + overhead_tokens + b) / prefill_tokens_per_s)

(the queue ahead of the request drains at the measured prefill speed, then its own prefill runs),
and the largest candidate whose prediction stays under the target wins, never below the floor.
When even the floor misses, the floor is the answer and the reason says so: the admission rules
(gateway/admission.py, the engine's waiting bound) decide whether it runs, nothing cuts deeper.

`BudgetController` keeps what the decision needs between requests: smoothed compression time,
prompt overhead, prefill speed (from responses, for an upstream that does not report its own) and
the ratio of measured to predicted TTFT; the prompt tokens of requests decided but not yet at their
first token (so a burst sees itself); and, per policy, the last budget, so budgets fall at once but
rise one step per `relax_interval_s` elapsed since the last change (no oscillation under bursts).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ctxgate.gateway.engine_load import EngineReading, LoadReader
from ctxgate.policies.schema import AdaptivePolicy

# Reasons, as usage.ctxgate.budget.reason and the metric's label say them.
CEILING = "ceiling"  # the loosest budget keeps the SLO
SLO = "slo"  # the largest budget that keeps the SLO (below the ceiling)
FLOOR_MISSES_SLO = "floor_misses_slo"  # even the floor is predicted to miss: admission decides
KV_PRESSURE = "kv_pressure"  # the KV cache is nearly full: the floor
NO_ESTIMATE = "no_estimate"  # no prefill speed measured yet: the policy's own budget
RISE_LIMITED = "rise_limited"  # the SLO allows more, the damping allows one step now (or none)
REASONS = (CEILING, SLO, FLOOR_MISSES_SLO, KV_PRESSURE, NO_ESTIMATE, RISE_LIMITED)

_CALIBRATION_RANGE = (0.5, 4.0)


@dataclass(frozen=True)
class EngineLoad:
    """The engine as one decision sees it."""

    waiting_tokens: int  # prompt tokens ahead of this request, not yet prefilled
    running: int  # sequences in the engine
    kv_usage: float  # 0..1
    prefill_tokens_per_s: float | None  # None: not measured yet


@dataclass(frozen=True)
class Estimates:
    """Smoothed measurements of earlier requests."""

    compression_s: float = 0.0  # the gateway's own work before the engine sees the request
    overhead_tokens: int = 0  # prompt tokens besides the documents (system, question, history, framing)
    calibration: float = 1.0  # measured TTFT / predicted TTFT


@dataclass(frozen=True)
class Decision:
    budget: int
    reason: str
    predicted_ttft_s: float | None  # for the chosen budget; None without a speed estimate

    def to_dict(self) -> dict[str, object]:
        predicted = None if self.predicted_ttft_s is None else round(self.predicted_ttft_s, 4)
        return {"documents_tokens": self.budget, "reason": self.reason, "predicted_ttft_s": predicted}


def candidate_budgets(adaptive: AdaptivePolicy) -> tuple[int, ...]:
    """floor, floor + step, ..., and the ceiling itself (ascending, no duplicates)."""
    values = list(range(adaptive.floor_tokens, adaptive.ceiling_tokens, adaptive.step_tokens))
    return (*values, adaptive.ceiling_tokens)


def predicted_ttft_s(load: EngineLoad, estimates: Estimates, budget: int) -> float | None:
    if not load.prefill_tokens_per_s or load.prefill_tokens_per_s <= 0:
        return None
    tokens = load.waiting_tokens + estimates.overhead_tokens + budget
    return estimates.calibration * (estimates.compression_s + tokens / load.prefill_tokens_per_s)


def choose_budget(
    load: EngineLoad,
    estimates: Estimates,
    candidates: Sequence[int],
    target_s: float,
    max_kv_usage: float,
    fallback: int,
) -> Decision:
    """The largest candidate (ascending, non-empty) whose predicted TTFT is at most `target_s`.

    Closed form: the prediction is linear in the budget, so the largest fitting budget is solved for
    and looked up (O(log n)), not searched."""
    floor, ceiling = candidates[0], candidates[-1]
    if load.kv_usage > max_kv_usage:
        return Decision(floor, KV_PRESSURE, predicted_ttft_s(load, estimates, floor))
    speed = load.prefill_tokens_per_s
    if not speed or speed <= 0:
        return Decision(min(max(fallback, floor), ceiling), NO_ESTIMATE, None)
    # calibration x (compression + (queued + b) / speed) <= target  <=>  b <= room
    room = (
        (target_s / estimates.calibration - estimates.compression_s) * speed
        - load.waiting_tokens
        - estimates.overhead_tokens
    )
    if room >= ceiling:
        return Decision(ceiling, CEILING, predicted_ttft_s(load, estimates, ceiling))
    index = bisect.bisect_right(candidates, room) - 1
    if index < 0:
        return Decision(floor, FLOOR_MISSES_SLO, predicted_ttft_s(load, estimates, floor))
    budget = candidates[index]
    return Decision(budget, SLO, predicted_ttft_s(load, estimates, budget))


def damp(
    target: Decision,
    last: int | None,
    last_rise_at: float,
    now: float,
    candidates: Sequence[int],
    relax_interval_s: float,
) -> tuple[Decision, bool]:
    """Fall at once, rise one candidate per `relax_interval_s` since the last change (a quiet minute
    after a burst is many steps, not one per request): (decision, whether it rose)."""
    if last is None or target.budget <= last:
        return target, False
    elapsed = now - last_rise_at
    if elapsed < relax_interval_s:
        return Decision(last, RISE_LIMITED, target.predicted_ttft_s), False
    steps = len(candidates) if relax_interval_s <= 0 else int(elapsed / relax_interval_s)
    index = bisect.bisect_right(candidates, last) + steps - 1  # `steps` candidates above the last budget
    budget = candidates[min(index, len(candidates) - 1)]
    if budget >= target.budget:
        return target, True
    return Decision(budget, RISE_LIMITED, target.predicted_ttft_s), True


class Smoothed:
    """An exponentially weighted mean; `prior` (None: nothing) until the first value."""

    def __init__(self, weight: float = 0.2, prior: float | None = None):
        self.weight = weight
        self.value: float | None = prior

    def add(self, value: float) -> None:
        self.value = value if self.value is None else (1 - self.weight) * self.value + self.weight * value


@dataclass
class _Trend:
    budget: int
    rose_at: float


@dataclass(frozen=True)
class Outcome:
    """What one request measured, for the estimates."""

    ttft_s: float  # compression + the engine's TTFT
    compression_s: float
    prompt_tokens: int
    prefill_ms: float


class BudgetController:
    """Chooses budgets per request, learning from the requests it chose them for. Thread-safe; each
    call is a few dictionary and float operations (microseconds)."""

    def __init__(self, reader: LoadReader, clock: Callable[[], float] = time.monotonic):
        self.reader = reader
        self.clock = clock
        self._lock = threading.Lock()
        self._compression = Smoothed()
        self._overhead = Smoothed()
        self._speed = Smoothed()  # prompt tokens / prefill seconds, from responses
        self._calibration = Smoothed(0.2, prior=1.0)  # one outlier (a cold start) moves it a fifth
        self._pending: dict[str, int] = {}  # request id -> prompt tokens not yet prefilled
        self._pending_tokens = 0
        self._trends: dict[str, _Trend] = {}
        self._predicted: dict[str, float] = {}  # request id -> predicted TTFT, for calibration

    def estimates(self) -> Estimates:
        return Estimates(
            compression_s=self._compression.value or 0.0,
            overhead_tokens=int(self._overhead.value or 0),
            calibration=self._calibration.value or 1.0,
        )

    def load(self) -> EngineLoad:
        """The engine's reading, with the requests decided here and not yet at their first token
        (a request still compressing is not in the engine's queue yet, but will be)."""
        reading: EngineReading = self.reader.read()
        speed = reading.prefill_tokens_per_s or self._speed.value
        return EngineLoad(
            waiting_tokens=max(reading.waiting_tokens, self._pending_tokens),
            running=reading.running,
            kv_usage=reading.kv_usage,
            prefill_tokens_per_s=speed,
        )

    def decide(self, request_id: str, policy_name: str, adaptive: AdaptivePolicy, fallback: int) -> Decision:
        """The request's documents budget; it counts as waiting until `first_token(request_id)`."""
        candidates = candidate_budgets(adaptive)
        with self._lock:
            estimates, load = self.estimates(), self.load()
            target = choose_budget(
                load,
                estimates,
                candidates,
                adaptive.ttft_slo_s * adaptive.headroom,
                adaptive.max_kv_usage,
                fallback,
            )
            now = self.clock()
            trend = self._trends.get(policy_name)
            decision, rose = damp(
                target,
                trend.budget if trend else None,
                trend.rose_at if trend else now,
                now,
                candidates,
                adaptive.relax_interval_s,
            )
            if decision is not target:  # held below the target: predict for the budget actually chosen
                decision = replace(
                    decision, predicted_ttft_s=predicted_ttft_s(load, estimates, decision.budget)
                )
            # The rise clock restarts at every change: after a fall, rising waits a full interval.
            changed = rose or trend is None or decision.budget < trend.budget
            self._trends[policy_name] = _Trend(decision.budget, now if changed else trend.rose_at)
            tokens = decision.budget + estimates.overhead_tokens
            self._pending[request_id] = tokens
            self._pending_tokens += tokens
            if decision.predicted_ttft_s is not None:
                self._predicted[request_id] = decision.predicted_ttft_s / estimates.calibration
        return decision

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done (or it never reached the engine): no longer queued."""
        with self._lock:
            self._pending_tokens -= self._pending.pop(request_id, 0)

    def observe(self, request_id: str, budget: int, outcome: Outcome) -> None:
        """Learn from a finished request that this controller decided."""
        self.first_token(request_id)
        with self._lock:
            self._compression.add(outcome.compression_s)
            self._overhead.add(max(0, outcome.prompt_tokens - budget))
            if outcome.prefill_ms > 0 and outcome.prompt_tokens >= 32:
                self._speed.add(outcome.prompt_tokens / (outcome.prefill_ms / 1000))
            predicted = self._predicted.pop(request_id, None)
            if predicted and outcome.ttft_s > 0:
                low, high = _CALIBRATION_RANGE
                self._calibration.add(min(high, max(low, outcome.ttft_s / predicted)))

    def budgets_in_force(self) -> dict[str, int]:
        """Each adaptive policy's documents budget as last decided (the one the next request starts from)."""
        with self._lock:
            return {policy: trend.budget for policy, trend in sorted(self._trends.items())}

    def forget(self, request_id: str) -> None:
        """A decided request that ended without an outcome (refused, failed)."""
        self.first_token(request_id)
        with self._lock:
            self._predicted.pop(request_id, None)
