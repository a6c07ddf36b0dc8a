"""The rerank stage: passages are scored against the question and the best `top_k` kept.

Rule: at most `rerank.top_k` (and `documents.max_documents`) passages pass the cut, at or above
`min_score`; kept passages stay in request order.
"""

from __future__ import annotations

from ctxgate.compression.rerank import (
    BM25Reranker,
    CrossEncoderReranker,
    EmbeddingReranker,
    FusedReranker,
    Reranker,
    refine_untitled,
)
from ctxgate.compression.stages.base import Stage, StageContext
from ctxgate.compression.stages.budget import passages_tokens
from ctxgate.compression.stages.prepare import ensure_candidates
from ctxgate.compression.state import PipelineState
from ctxgate.compression.types import StageReport
from ctxgate.policies.schema import Policy


class RerankStage(Stage):
    name = "rerank"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        return state.compressing and policy.rerank.enabled

    def reranker(self, ctx: StageContext) -> Reranker:
        policy = ctx.policy.rerank
        if policy.method == "embedding":
            return EmbeddingReranker(ctx.services.embedder)
        if policy.method == "bm25":
            return BM25Reranker()
        if policy.method == "cross-encoder":
            if not policy.cross_encoder_path:
                raise ValueError("rerank.method 'cross-encoder' needs rerank.cross_encoder_path")
            return CrossEncoderReranker(policy.cross_encoder_path)
        if policy.method == "llm":
            return ctx.services.llm_reranker()
        return FusedReranker(ctx.services.embedder, policy.bm25_weight)

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        policy = ctx.policy.rerank
        report = StageReport(self.name, details={"method": policy.method})
        if not state.passages:
            return report
        before = passages_tokens(ctx.counter, state.passages)
        ensure_candidates(ctx, state)
        reranker = self.reranker(ctx)
        scores = reranker.score(state.question_text, state.passages)
        limit = min(
            policy.top_k or len(state.passages), ctx.policy.documents.max_documents or len(state.passages)
        )
        scores = refine_untitled(reranker, state.question_text, state.passages, scores, limit)
        for passage, score in zip(state.passages, scores, strict=True):
            passage.score = float(score)
        ranked = sorted(state.passages, key=lambda p: (-p.score, p.position))
        if policy.min_score is not None:
            ranked = [p for p in ranked if p.score >= policy.min_score]
        limit = min(limit, len(ranked))
        kept = {id(p) for p in ranked[:limit]}
        state.passages = [p for p in state.passages if id(p) in kept]
        report.details["kept"] = len(state.passages)
        report.saved_tokens = before - passages_tokens(ctx.counter, state.passages)
        return report
