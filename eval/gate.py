"""The regression gate: compare a current eval report against a baseline, arm by arm.

A metric fails when its drop (baseline − current) exceeds the allowed margin. The drop's interval
comes from a paired bootstrap over the questions both reports scored, so the message says whether a
drop is larger than the noise of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxgate.eval.stats import paired_bootstrap_difference


@dataclass
class MetricCheck:
    arm: str
    metric: str
    baseline: float | None
    current: float | None
    drop: float | None
    drop_ci: tuple[float, float] | None
    allowed_drop: float
    passed: bool
    note: str = ""

    def describe(self) -> str:
        status = "ok  " if self.passed else "FAIL"
        if self.drop is None:
            return f"{status} {self.arm}: {self.metric}: {self.note or 'not measured'}"
        interval = (
            f"95% CI of drop [{self.drop_ci[0]:+.3f}, {self.drop_ci[1]:+.3f}]"
            if self.drop_ci
            else "no interval"
        )
        verb = "dropped" if self.drop > 0 else "changed"
        return (
            f"{status} {self.arm}: {self.metric} {verb} by {self.drop:+.3f} "
            f"({self.baseline:.3f} -> {self.current:.3f}; {interval}; allowed drop {self.allowed_drop:.3f})"
            + (f"; {self.note}" if self.note else "")
        )


@dataclass
class GateResult:
    checks: list[MetricCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems and all(check.passed for check in self.checks)

    def describe(self) -> str:
        lines = [check.describe() for check in self.checks] + [f"FAIL {problem}" for problem in self.problems]
        failures = [check for check in self.checks if not check.passed]
        verdict = "PASSED" if self.passed else f"FAILED ({len(failures) + len(self.problems)} regression(s))"
        return "\n".join(lines + [f"gate {verdict}"])


def _per_question(arm: dict[str, Any], metric: str) -> dict[str, float | None]:
    scores = arm.get("per_question") or {}
    return {
        question_id: (None if values.get(metric) is None else float(values[metric]))
        for question_id, values in scores.items()
    }


def check_metric(
    arm_label: str,
    metric: str,
    baseline_arm: dict[str, Any],
    current_arm: dict[str, Any],
    allowed_drop: float,
) -> MetricCheck:
    baseline_value = (baseline_arm.get(metric) or {}).get("value")
    current_value = (current_arm.get(metric) or {}).get("value")
    if baseline_value is None or current_value is None:
        return MetricCheck(
            arm_label,
            metric,
            baseline_value,
            current_value,
            None,
            None,
            allowed_drop,
            True,
            note="not measured in both reports (skipped)",
        )
    drop = round(baseline_value - current_value, 6)
    difference = paired_bootstrap_difference(
        _per_question(baseline_arm, metric), _per_question(current_arm, metric)
    )
    note = ""
    drop_ci = None
    if difference.n and difference.ci_low is not None and difference.ci_high is not None:
        # drop = -(current - baseline): the interval flips.
        drop_ci = (-difference.ci_high, -difference.ci_low)
        baseline_ids = set(baseline_arm.get("per_question") or {})
        if difference.n < len(baseline_ids):
            note = f"interval over the {difference.n} questions both reports scored"
    else:
        note = "no shared per-question scores for an interval"
    passed = drop <= allowed_drop + 1e-12
    return MetricCheck(
        arm_label, metric, baseline_value, current_value, drop, drop_ci, allowed_drop, passed, note
    )


def run_gate(
    baseline: dict[str, Any],
    current: dict[str, Any],
    max_accuracy_drop: float,
    max_retention_drop: float,
    max_f1_drop: float | None = None,
) -> GateResult:
    if max_accuracy_drop < 0 or max_retention_drop < 0 or (max_f1_drop is not None and max_f1_drop < 0):
        raise ValueError("allowed drops must be >= 0")
    limits = {"accuracy": max_accuracy_drop, "answer_retention": max_retention_drop}
    if max_f1_drop is not None:
        limits["f1"] = max_f1_drop
    result = GateResult()
    baseline_dataset = (baseline.get("dataset") or {}).get("sha256")
    current_dataset = (current.get("dataset") or {}).get("sha256")
    if baseline_dataset and current_dataset and baseline_dataset != current_dataset:
        result.problems.append("the two reports were run on different datasets (sha256 differs)")
    for arm_label, baseline_arm in baseline["arms"].items():
        current_arm = current["arms"].get(arm_label)
        if current_arm is None:
            result.problems.append(f"{arm_label}: arm missing from the current report")
            continue
        for metric, allowed in limits.items():
            result.checks.append(check_metric(arm_label, metric, baseline_arm, current_arm, allowed))
        if current_arm.get("errors", 0) > baseline_arm.get("errors", 0):
            result.problems.append(
                f"{arm_label}: failed requests rose from {baseline_arm.get('errors', 0)} to {current_arm['errors']}"
            )
    return result
