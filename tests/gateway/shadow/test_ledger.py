"""The shadow ledger: summaries per tenant and policy, the newest disagreements, bounded memory."""

from __future__ import annotations

from ctxgate.gateway.shadow.ledger import ShadowLedger, ShadowRecord, shadow_summary


def _record(tenant: str, policy: str, agreement: float, at: float) -> ShadowRecord:
    return ShadowRecord(
        request_id=f"{tenant}-{at}",
        tenant=tenant,
        policy=policy,
        model="m",
        comparison="token_f1",
        agreement=agreement,
        measures={"token_f1": agreement},
        prompt_tokens_live=100,
        prompt_tokens_shadow=400,
        completion_tokens_live=5,
        completion_tokens_shadow=6,
        live_answer="a",
        shadow_answer="b",
        at=at,
    )


def test_a_tenant_sees_its_own_policies_and_disagreements_only():
    ledger = ShadowLedger(recent=10)
    ledger.record(_record("acme", "p", 1.0, 1))
    ledger.record(_record("acme", "p", 0.5, 2))
    ledger.record(_record("globex", "p", 0.0, 3))
    ledger.dropped("globex", "q", "busy")
    for tenant, policy in (("acme", "p"), ("acme", "p"), ("globex", "p"), ("globex", "q")):
        ledger.sampled(tenant, policy)
    acme = shadow_summary(ledger, "acme")
    assert [(p.policy, p.comparisons, p.mean_agreement, p.disagreements) for p in acme.policies] == [
        ("p", 2, 0.75, 1)
    ]
    assert [r.request_id for r in acme.recent_disagreements] == ["acme-2"]
    everyone = shadow_summary(ledger, None)
    assert {p.policy: p.comparisons for p in everyone.policies} == {"p": 3, "q": 0}
    assert {p.policy: p.dropped for p in everyone.policies}["q"] == {"busy": 1}
    assert {p.policy: p.sampled for p in everyone.policies} == {"p": 3, "q": 1}
    assert [p.sampled for p in acme.policies] == [2]
    assert [r.request_id for r in everyone.recent_disagreements] == ["globex-3", "acme-2"]  # newest first
    assert everyone.as_dict()["policies"][0]["mean_agreement"] == 0.5


def test_memory_is_bounded_in_groups_and_disagreements():
    ledger = ShadowLedger(recent=3, max_groups=5)
    for index in range(100):
        ledger.record(_record(f"tenant-{index}", "p", 0.0, index))
    for index in range(10):
        ledger.record(_record("acme", "p", 0.0, 1000 + index))
    groups, tenants = ledger.held
    assert groups == 5 and tenants <= 5
    assert [r.at for r in shadow_summary(ledger, "acme").recent_disagreements] == [1009, 1008, 1007]
