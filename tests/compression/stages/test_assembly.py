"""The assembly stage (compression/stages/assembly.py)."""

from __future__ import annotations

from ctxgate.compression.stages.assembly import AssemblyStage
from ctxgate.policies.schema import Policy
from tests.compression.stages.support import DOCUMENTS, setup_state


async def test_assembly_orders_passages_as_the_policy_says(tokenizer):
    policy = Policy(name="p", assembly={"order": "best-at-ends"})
    state, ctx = setup_state(tokenizer, policy, documents=DOCUMENTS[:5])
    for passage, score in zip(state.passages, [0.1, 0.9, 0.5, 0.7, 0.3], strict=True):
        passage.score = score
    report = await AssemblyStage().run(state, ctx)
    assert [p.score for p in state.passages] == [0.9, 0.5, 0.1, 0.3, 0.7]
    assert report.details == {"order": "best-at-ends"} and report.saved_tokens == 0
