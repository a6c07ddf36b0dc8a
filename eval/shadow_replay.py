"""`ctxgate eval shadow-replay LOG`: the gateway's shadow log (`server.shadow_log`, one JSON line per
comparison) scored again offline with the gateway's own comparison (ctxgate.gateway.shadow.compare).

- Without `--candidate`: each logged live answer against its shadow answer, under the comparison asked
  for (another measure than the policy's, or the current code's measures on an old log).
- With `--candidate FILE` (JSON lines of `request_id` and `answer`): a candidate policy's answers to
  the same requests (the operator re-sent its own stored requests under the new policy) against the
  logged shadow answers, beside the live policy's agreement: a new policy checked against last
  week's traffic before it is rolled out.

Lines that are not JSON objects with the fields a comparison needs are counted as skipped.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ctxgate.gateway.shadow.compare import compare
from ctxgate.policies.shadow import Comparison


@dataclass(frozen=True)
class LoggedComparison:
    request_id: str
    policy: str
    live_answer: str
    shadow_answer: str


@dataclass
class PolicyReplay:
    policy: str
    comparisons: int = 0
    mean_agreement: float = 0.0  # the live answers against the shadow answers
    candidate_comparisons: int = 0
    candidate_mean_agreement: float | None = None  # the candidate's answers, same requests
    measures: dict[str, float] = field(default_factory=dict)  # each measure's mean, where it applied


@dataclass
class ReplayReport:
    comparison: str
    policies: list[PolicyReplay]
    skipped: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_log(lines: Iterable[str]) -> tuple[list[LoggedComparison], int]:
    entries, skipped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            entries.append(
                LoggedComparison(
                    str(item["request_id"]),
                    str(item["policy"]),
                    str(item["live_answer"]),
                    str(item["shadow_answer"]),
                )
            )
        except (ValueError, KeyError, TypeError):
            skipped += 1
    return entries, skipped


def read_candidate(path: Path) -> dict[str, str]:
    answers: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            item = json.loads(line)
            answers[str(item["request_id"])] = str(item["answer"])
    return answers


def replay(
    entries: list[LoggedComparison],
    comparison: Comparison = "auto",
    candidate: dict[str, str] | None = None,
    sample: int | None = None,
    seed: int = 0,
    skipped: int = 0,
) -> ReplayReport:
    if sample is not None and sample < len(entries):
        entries = random.Random(seed).sample(entries, sample)
    live: dict[str, list[float]] = defaultdict(list)
    candidates: dict[str, list[float]] = defaultdict(list)
    measures: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for entry in entries:
        agreement = compare(entry.live_answer, entry.shadow_answer)
        live[entry.policy].append(agreement.headline(comparison)[1])
        for name, value in agreement.as_dict().items():
            if value is not None:
                measures[entry.policy][name].append(value)
        if candidate is not None and entry.request_id in candidate:
            candidate_agreement = compare(candidate[entry.request_id], entry.shadow_answer)
            candidates[entry.policy].append(candidate_agreement.headline(comparison)[1])
    policies = []
    for policy in sorted(live):
        values, candidate_values = live[policy], candidates.get(policy, [])
        policies.append(
            PolicyReplay(
                policy=policy,
                comparisons=len(values),
                mean_agreement=round(sum(values) / len(values), 4),
                candidate_comparisons=len(candidate_values),
                candidate_mean_agreement=round(sum(candidate_values) / len(candidate_values), 4)
                if candidate_values
                else None,
                measures={name: round(sum(v) / len(v), 4) for name, v in sorted(measures[policy].items())},
            )
        )
    return ReplayReport(comparison, policies, skipped)


def describe(report: ReplayReport) -> str:
    lines = [f"comparison: {report.comparison}; skipped lines: {report.skipped}"]
    for item in report.policies:
        line = f"{item.policy}: {item.comparisons} compared, mean agreement {item.mean_agreement:.3f}"
        if item.candidate_mean_agreement is not None:
            line += f"; candidate {item.candidate_mean_agreement:.3f} on {item.candidate_comparisons} of them"
        lines.append(line)
    return "\n".join(lines)
