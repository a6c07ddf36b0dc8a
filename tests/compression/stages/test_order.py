"""The order of the stages (compression/stages/__init__.py) and when each runs."""

from __future__ import annotations

from ctxgate.compression.stages import STAGES
from ctxgate.compression.types import RetrievalSpec
from ctxgate.policies.schema import Policy
from tests.compression.stages.support import setup_state


def test_stage_order_is_the_algorithm():
    assert [stage.name for stage in STAGES] == [
        "retrieval",
        "message-context",
        "cost-check",
        "conversation",
        "history",
        "dedup",
        "rerank",
        "extraction",
        "assembly",
        "fit",
    ]


def test_enabled_follows_the_request_the_policy_and_the_cost_check(tokenizer):
    policy = Policy(name="p", history={"enabled": False}, dedup={"enabled": True}, rerank={"enabled": False})
    state, _ = setup_state(tokenizer, policy)
    enabled = [stage.name for stage in STAGES if stage.enabled(state, policy)]
    assert enabled == ["cost-check", "dedup", "extraction", "assembly", "fit"]
    state.retrieval = RetrievalSpec(index="wiki")
    assert STAGES[0].enabled(state, policy)
    # Once the cost check skips compression only the measuring and the fit remain.
    state.skip_reason = "compression disabled by policy"
    assert [stage.name for stage in STAGES if stage.enabled(state, policy)] == [
        "retrieval",
        "cost-check",
        "fit",
    ]
