"""What the shadow comparisons found, kept for `/v1/ctxgate/shadow` and the operator console: per
tenant and policy, how many requests were sampled, how many comparisons and their mean agreement,
the drops by reason, and the last disagreements. Every sampled request is compared, dropped with a
reason, or still running: sampled = comparisons + dropped + in flight. Memory is bounded: at most `max_groups` (tenant, policy) pairs (the least recently
updated forgotten first) and `recent` disagreements per tenant, each answer cut to `ANSWER_CHARS`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any

ANSWER_CHARS = 300


@dataclass(frozen=True)
class ShadowRecord:
    """One comparison: the live answer (compressed prompt) against the shadow's (uncompressed)."""

    request_id: str
    tenant: str
    policy: str
    model: str
    comparison: str  # the measure `agreement` is (the policy's choice, resolved)
    agreement: float
    measures: dict[str, float | None]
    prompt_tokens_live: int  # after compression
    prompt_tokens_shadow: int  # before: the uncompressed prompt
    completion_tokens_live: int
    completion_tokens_shadow: int
    live_answer: str
    shadow_answer: str
    at: float  # Unix time

    @property
    def disagrees(self) -> bool:
        return self.agreement < 1.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PolicySummary:
    policy: str
    sampled: int  # drawn by sample_rate (or upstream_fixed_rate): compared, dropped or running
    comparisons: int
    mean_agreement: float | None  # None: no comparison yet
    disagreements: int
    dropped: dict[str, int]  # by reason


@dataclass(frozen=True)
class ShadowSummary:
    """`/v1/ctxgate/shadow`'s body: per policy, then the last disagreements, newest first."""

    policies: list[PolicySummary]
    recent_disagreements: list[ShadowRecord]

    def as_dict(self) -> dict[str, Any]:
        return {
            "policies": [asdict(item) for item in self.policies],
            "recent_disagreements": [record.as_dict() for record in self.recent_disagreements],
        }


@dataclass
class _Group:
    sampled: int = 0
    comparisons: int = 0
    agreement_sum: float = 0.0
    disagreements: int = 0
    dropped: Counter[str] = field(default_factory=Counter)


class ShadowLedger:
    def __init__(self, recent: int = 50, max_groups: int = 4096):
        self.recent = recent
        self.max_groups = max_groups
        self._groups: OrderedDict[tuple[str, str], _Group] = OrderedDict()
        self._disagreements: OrderedDict[str, deque[ShadowRecord]] = OrderedDict()

    def _group(self, tenant: str, policy: str) -> _Group:
        key = (tenant, policy)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group()
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        self._groups.move_to_end(key)
        return group

    def record(self, record: ShadowRecord) -> None:
        group = self._group(record.tenant, record.policy)
        group.comparisons += 1
        group.agreement_sum += record.agreement
        if not record.disagrees:
            return
        group.disagreements += 1
        if self.recent == 0:
            return
        kept = self._disagreements.get(record.tenant)
        if kept is None:
            kept = self._disagreements[record.tenant] = deque(maxlen=self.recent)
            while len(self._disagreements) > self.max_groups:
                self._disagreements.popitem(last=False)
        self._disagreements.move_to_end(record.tenant)
        kept.append(record)

    @property
    def held(self) -> tuple[int, int]:
        """(tenant and policy pairs, tenants with disagreements) held now: what bounds the memory."""
        return len(self._groups), len(self._disagreements)

    def sampled(self, tenant: str, policy: str) -> None:
        self._group(tenant, policy).sampled += 1

    def dropped(self, tenant: str, policy: str, reason: str) -> None:
        self._group(tenant, policy).dropped[reason] += 1

    def summary(self, tenant: str | None) -> ShadowSummary:
        """`tenant`'s own comparisons; None: every tenant's (an open gateway, the operator)."""
        totals: dict[str, _Group] = {}
        for (owner, policy), group in self._groups.items():
            if tenant is not None and owner != tenant:
                continue
            total = totals.setdefault(policy, _Group())
            total.sampled += group.sampled
            total.comparisons += group.comparisons
            total.agreement_sum += group.agreement_sum
            total.disagreements += group.disagreements
            total.dropped.update(group.dropped)
        policies = [
            PolicySummary(
                policy=policy,
                sampled=group.sampled,
                comparisons=group.comparisons,
                mean_agreement=round(group.agreement_sum / group.comparisons, 4)
                if group.comparisons
                else None,
                disagreements=group.disagreements,
                dropped=dict(group.dropped),
            )
            for policy, group in sorted(totals.items())
        ]
        owners = [tenant] if tenant is not None else list(self._disagreements)
        recent = [record for owner in owners for record in self._disagreements.get(owner, ())]
        recent.sort(key=lambda record: record.at, reverse=True)
        return ShadowSummary(policies, recent[: self.recent])


def shadow_summary(ledger: ShadowLedger, tenant: str | None) -> ShadowSummary:
    """The typed summary the operator console reads: `tenant`'s, or every tenant's with None."""
    return ledger.summary(tenant)
