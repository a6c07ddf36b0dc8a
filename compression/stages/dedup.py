"""The dedup stage: exact and near-duplicate passages, then sentences, are removed.

Rule: of duplicates the one with the best retrieval score (else the earliest) stays; sentences the
pre-filter left unembedded are deduplicated exactly only.
"""

from __future__ import annotations

import numpy as np

from ctxgate.compression.dedup import duplicate_indices
from ctxgate.compression.rerank import passage_embedding_texts, passage_text_for_scoring, passage_vectors
from ctxgate.compression.stages.base import Stage, StageContext
from ctxgate.compression.stages.budget import passages_tokens
from ctxgate.compression.stages.prepare import embed_with_question, ensure_candidates, ensure_sentences
from ctxgate.compression.state import Passage, PipelineState
from ctxgate.compression.types import StageReport
from ctxgate.policies.schema import Policy


class DedupStage(Stage):
    name = "dedup"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        return state.compressing and policy.dedup.enabled

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        policy = ctx.policy.dedup
        report = StageReport(self.name)
        if not state.passages:
            return report
        if policy.sentence_level:
            ensure_sentences(ctx, state.passages)  # split first: priced by sentence, each counted once
        before = passages_tokens(ctx.counter, state.passages)
        near = policy.near_duplicate_cosine
        embedder = ctx.services.embedder if near is not None else None
        texts = [passage_text_for_scoring(p) for p in state.passages]
        vectors = None
        if embedder is not None:
            ensure_candidates(ctx, state)
            embed_with_question(ctx, state, passage_embedding_texts(state.passages))
            vectors = passage_vectors(embedder, state.passages)
        priority = [p.document.score if p.document.score is not None else 0.0 for p in state.passages]
        dropped = duplicate_indices(texts, vectors, policy.exact, near, priority)
        state.passages = [p for i, p in enumerate(state.passages) if i not in dropped]
        report.details["passages_removed"] = len(dropped)

        if policy.sentence_level:
            ensure_sentences(ctx, state.passages)
            owners = [(pi, si) for pi, p in enumerate(state.passages) for si in range(len(p.sentences or []))]
            sentences = [state.passages[pi].sentences[si] for pi, si in owners]
            sentence_vectors = None
            if embedder is not None:
                # Sentences the pre-filter left out get a zero vector: exact dedup only.
                wanted = [
                    position
                    for position, (pi, si) in enumerate(owners)
                    if state.passages[pi].embed_sentences is None or si in state.passages[pi].embed_sentences
                ]
                sentence_vectors = np.zeros((len(sentences), embedder.dimension), dtype=np.float32)
                if wanted:
                    sentence_vectors[wanted] = embedder.embed([sentences[i] for i in wanted])
            sentence_priority = [priority_of(state.passages[pi]) for pi, _ in owners]
            dropped_sentences = duplicate_indices(
                sentences, sentence_vectors, policy.exact, near, sentence_priority
            )
            for position in dropped_sentences:
                pi, si = owners[position]
                state.passages[pi].removed_sentences.add(si)
            state.passages = [p for p in state.passages if not p.is_empty()]
            report.details["sentences_removed"] = len(dropped_sentences)
        report.saved_tokens = before - passages_tokens(ctx.counter, state.passages)
        return report


def priority_of(passage: Passage) -> float:
    return passage.document.score if passage.document.score is not None else -passage.position * 1e-6
