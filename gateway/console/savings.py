"""Per tenant and policy: prompt tokens before and after compression, tokens and estimated prefill
time saved; per policy: requests fitted to a limit or refused; per tenant: quota refusals. All from
the gateway's own Prometheus counters (`ctxgate.gateway.metrics`) over a `Window`."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ctxgate.gateway.console.counter_history import Labels, Window

ORIGINAL = "ctxgate:prompt_tokens_original"
SENT = "ctxgate:prompt_tokens_sent"
COMPLETION = "ctxgate:completion_tokens"
FIT = "ctxgate:fit_requests"
BUDGET_REFUSED = "ctxgate:budget_rejections"
QUOTA_REFUSED = "ctxgate:quota_rejections"
COUNTERS = (ORIGINAL, SENT, COMPLETION, FIT, BUDGET_REFUSED, QUOTA_REFUSED)


@dataclass(frozen=True)
class TenantPolicyRow:
    tenant: str
    policy: str
    tokens_before: int
    tokens_after: int
    completion_tokens: int
    prefill_s_saved: float | None  # None: no prefill speed measured yet

    @property
    def tokens_saved(self) -> int:
        return self.tokens_before - self.tokens_after


@dataclass(frozen=True)
class PolicyOutcomeRow:
    policy: str
    fitted: int  # over a limit, compressed to fit
    refused: int  # over a limit and refused (fit), or its fixed parts alone over the budget (413)


@dataclass(frozen=True)
class Savings:
    rows: list[TenantPolicyRow]
    outcomes: list[PolicyOutcomeRow]
    quota_refusals: dict[str, int]  # tenant -> requests refused by a quota

    @property
    def total_before(self) -> int:
        return sum(row.tokens_before for row in self.rows)

    @property
    def total_after(self) -> int:
        return sum(row.tokens_after for row in self.rows)


def _label(labels: Labels, name: str) -> str:
    return dict(labels).get(name, "")


def savings(window: Window, prefill_tokens_per_s: float | None) -> Savings:
    values = window.values
    keys = set(values.get(ORIGINAL, {})) | set(values.get(SENT, {}))
    rows = []
    for labels in sorted(keys):
        before = int(values.get(ORIGINAL, {}).get(labels, 0))
        after = int(values.get(SENT, {}).get(labels, 0))
        completion = int(values.get(COMPLETION, {}).get(labels, 0))
        if before == after == completion == 0:  # no request of this tenant and policy in the range
            continue
        saved_s = (before - after) / prefill_tokens_per_s if prefill_tokens_per_s else None
        rows.append(
            TenantPolicyRow(
                tenant=_label(labels, "tenant"),
                policy=_label(labels, "policy"),
                tokens_before=before,
                tokens_after=after,
                completion_tokens=completion,
                prefill_s_saved=saved_s,
            )
        )
    fitted: dict[str, int] = defaultdict(int)
    refused: dict[str, int] = defaultdict(int)
    for labels, value in values.get(FIT, {}).items():
        if not value:
            continue
        target = fitted if _label(labels, "outcome") == "fitted" else refused
        target[_label(labels, "policy")] += int(value)
    for labels, value in values.get(BUDGET_REFUSED, {}).items():
        if value:
            refused[_label(labels, "policy")] += int(value)
    outcomes = [
        PolicyOutcomeRow(policy, fitted.get(policy, 0), refused.get(policy, 0))
        for policy in sorted(set(fitted) | set(refused))
    ]
    quota: dict[str, int] = defaultdict(int)
    for labels, value in values.get(QUOTA_REFUSED, {}).items():
        if value:
            quota[_label(labels, "tenant")] += int(value)
    return Savings(rows, outcomes, dict(sorted(quota.items())))
