"""The retrieval stage: passages from a stored index join the request's documents.

Rule: it runs first, before anything is measured, so the original prompt and the cost check
include the retrieved passages; retrieved text is neutralised like client text, and a changed
sentence keeps its stored vector.
"""

from __future__ import annotations

from ctxgate.compression.stages.base import Stage, StageContext
from ctxgate.compression.state import Passage, PipelineState
from ctxgate.compression.types import Document, StageReport
from ctxgate.policies.schema import Policy


class RetrievalStage(Stage):
    """Passages from a stored index join the request's documents (before anything is measured)."""

    name = "retrieval"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        return state.retrieval is not None

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        assert state.retrieval is not None
        index = ctx.services.index_store.get(state.retrieval.index)
        hits = index.search(ctx.question_vector(state), state.retrieval.top_n)
        first_position = len(state.passages)
        clean = state.neutralise or (lambda text: text)
        for rank, (chunk_id, score) in enumerate(hits):
            sentences, vectors = index.sentences_with_vectors(chunk_id)
            sentences = [clean(sentence) for sentence in sentences]  # a changed sentence keeps its vector
            ctx.services.embedder.prime(sentences, vectors)
            document = index.document(chunk_id, score)
            document = Document(
                text=clean(document.text),
                id=document.id,
                score=document.score,
                title=None if document.title is None else clean(document.title),
            )
            passage = Passage(document=document, position=first_position + rank, score=score)
            passage.sentences = sentences
            state.passages.append(passage)
        return StageReport(self.name, details={"index": state.retrieval.index, "retrieved": len(hits)})
