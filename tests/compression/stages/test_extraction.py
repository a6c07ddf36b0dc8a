"""The extraction stage (compression/stages/extraction.py): the passages block fits its budget."""

from __future__ import annotations

from ctxgate.compression.rendering import render_context
from ctxgate.compression.stages.extraction import ExtractionStage
from ctxgate.policies.schema import Policy
from tests.compression.stages.support import DOCUMENTS, setup_state


async def test_extraction_by_passage_fits_the_documents_budget(tokenizer):
    policy = Policy(
        name="p", max_input_tokens=2000, documents={"max_tokens": 70}, extraction={"unit": "passage"}
    )
    state, ctx = setup_state(tokenizer, policy, documents=DOCUMENTS)
    for rank, passage in enumerate(state.passages):
        passage.score = 1.0 - rank / 10
    report = await ExtractionStage().run(state, ctx)
    assert report.details["budget"] == 70
    assert 0 < tokenizer.count(render_context(state.passages)) <= 70
    assert [p.title for p in state.passages] == ["T0", "T1"][: len(state.passages)]  # best scores kept
    assert report.saved_tokens > 0
