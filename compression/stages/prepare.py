"""Work done once per request, by whichever stage needs it first: splitting passages into
sentences, the lexical pre-filter's choice of what gets embedded, and the question's embedding.

Rule: the pre-filter runs before anything is embedded, and at most once; retrieved passages skip
it (their vectors come from the index).
"""

from __future__ import annotations

from ctxgate.compression.prefilter import mark_embedding_candidates
from ctxgate.compression.stages.base import StageContext
from ctxgate.compression.stages.budget import documents_budget
from ctxgate.compression.state import Passage, PipelineState, split_passages


def ensure_sentences(ctx: StageContext, passages: list[Passage]) -> None:
    split_passages(passages, ctx.services.splitter.split)


def ensure_candidates(ctx: StageContext, state: PipelineState) -> None:
    """Run the lexical pre-filter once per request, before anything is embedded."""
    if state.prefiltered or state.retrieval is not None:
        return  # retrieved passages bring their vectors from the index: embedding them is free
    state.prefiltered = True
    ensure_sentences(ctx, state.passages)
    documents = ctx.policy.documents
    mark_embedding_candidates(
        state.question_text,
        state.passages,
        documents_budget(state, ctx),
        documents.embed_budget_multiple,
        documents.embed_min_share,
    )


def embed_with_question(ctx: StageContext, state: PipelineState, texts: list[str]) -> None:
    """Embed `texts` and the question in one model call (later calls find them in the embedder's
    cache): every call has a fixed cost, ~10 ms for the question alone, and in the gateway each is
    a round trip to the embedding process."""
    if state.question_vector is not None:
        ctx.services.embedder.embed(texts)
        return
    vectors = ctx.services.embedder.embed([*texts, state.question_text])
    state.question_vector = vectors[-1]
