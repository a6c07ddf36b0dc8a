"""The pipeline's stages: small classes in a registry, each configured by its policy section.

Every stage mutates the `PipelineState` and returns a `StageReport` with the tokens it removed
(estimated from cached per-unit counts; the assembly stage reconciles with the exact total).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from compression.counting import CachedCounter
from compression.dedup import duplicate_indices
from compression.extraction import (
    drop_lowest_sentence,
    score_sentences,
    select_sentences,
    trim_block_to_budget,
    values_from_scores,
)
from compression.knapsack import knapsack
from compression.prefilter import mark_embedding_candidates
from compression.rendering import SUMMARY_HEADER, order_passages, render_context, summary_text
from compression.rerank import (
    BM25Reranker,
    CrossEncoderReranker,
    EmbeddingReranker,
    FusedReranker,
    Reranker,
    passage_text_for_scoring,
    passage_vectors,
)
from compression.state import Passage, PipelineState, message_text
from compression.types import StageReport
from policies.schema import Policy

MESSAGE_FRAMING_TOKENS = 5  # role + start/end markers around one chat message (estimate)


@dataclass
class StageContext:
    """Services a stage may use; heavy ones are created on first use by the pipeline."""

    policy: Policy
    counter: CachedCounter
    services: Any  # compression.pipeline.Services
    notes: dict[str, Any] = field(default_factory=dict)

    def question_vector(self, state: PipelineState) -> np.ndarray:
        if state.question_vector is None:
            state.question_vector = self.services.embedder.embed([state.question_text])[0]
        return state.question_vector


def turn_cost(counter: CachedCounter, message: dict[str, Any]) -> int:
    return counter.count(message_text(message)) + MESSAGE_FRAMING_TOKENS


def history_tokens(counter: CachedCounter, state: PipelineState) -> int:
    total = sum(turn_cost(counter, m) for m in state.history)
    if state.summary:
        total += counter.count(summary_text(state.summary)) + MESSAGE_FRAMING_TOKENS
    return total


def passages_tokens(counter: CachedCounter, passages: list[Passage]) -> int:
    bodies = [passage.body() for passage in passages]
    return sum(counter.count_many([body for body in bodies if body.strip()]))


def ensure_sentences(ctx: StageContext, passages: list[Passage]) -> None:
    for passage in passages:
        if passage.sentences is None:
            passage.sentences = ctx.services.splitter.split(passage.text) or [passage.text]


def ensure_candidates(ctx: StageContext, state: PipelineState) -> None:
    """Run the lexical pre-filter once per request, before anything is embedded."""
    if ctx.notes.get("prefiltered") or state.retrieval is not None:
        return  # retrieved passages bring their vectors from the index: embedding them is free
    ctx.notes["prefiltered"] = True
    ensure_sentences(ctx, state.passages)
    ctx.notes["not_embedded"] = mark_embedding_candidates(
        state.question_text, state.passages, documents_budget(state, ctx)
    )


class Stage:
    name: ClassVar[str]

    def enabled(self, policy: Policy) -> bool:
        return True

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        raise NotImplementedError


class HistoryStage(Stage):
    name = "history"

    def enabled(self, policy: Policy) -> bool:
        return policy.history.enabled

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        policy = ctx.policy.history
        counter = ctx.counter
        before = history_tokens(counter, state)
        budget = state.history_budget
        report = StageReport(self.name, details={"turns": len(state.history), "budget": budget})
        if before <= budget:
            return report
        costs = [turn_cost(counter, m) for m in state.history]
        if policy.strategy == "truncate":
            keep_from = len(costs)
            spent = 0
            while keep_from > 0 and spent + costs[keep_from - 1] <= budget:
                keep_from -= 1
                spent += costs[keep_from]
            report.details["dropped_turns"] = keep_from
            state.history = state.history[keep_from:]
        else:
            verbatim_start = max(0, len(state.history) - policy.keep_last_turns)
            while verbatim_start < len(costs) and sum(costs[verbatim_start:]) > budget:
                verbatim_start += 1  # even the kept turns must fit the promise
            older = state.history[:verbatim_start]
            summary_overhead = counter.count(SUMMARY_HEADER) + MESSAGE_FRAMING_TOKENS + 1
            summary_budget = min(
                policy.summary_max_tokens, budget - sum(costs[verbatim_start:]) - summary_overhead
            )
            summary = None
            if older and summary_budget >= 8:
                outcome = await ctx.services.summarizer.summarize(
                    state.tenant,
                    older,
                    state.question_text,
                    summary_budget,
                    policy.summary_timeout_s,
                    use_engine=policy.strategy == "summarize",
                )
                summary = outcome.text or None
                report.details.update(
                    summary_source=outcome.source,
                    engine_calls=outcome.engine_calls,
                    summarized_turns=len(older),
                )
            state.history = state.history[verbatim_start:]
            state.summary = summary
        report.saved_tokens = before - history_tokens(counter, state)
        return report


class RetrievalStage(Stage):
    name = "retrieval"

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        report = StageReport(self.name)
        if state.retrieval is None:
            return report
        index = ctx.services.index_store.get(state.retrieval.index)
        hits = index.search(ctx.question_vector(state), state.retrieval.top_n)
        first_position = len(state.passages)
        for rank, (chunk_id, score) in enumerate(hits):
            sentences, vectors = index.sentences_with_vectors(chunk_id)
            ctx.services.embedder.prime(sentences, vectors)
            passage = Passage(
                document=index.document(chunk_id, score), position=first_position + rank, score=score
            )
            passage.sentences = list(sentences)
            state.passages.append(passage)
        report.details = {"index": state.retrieval.index, "retrieved": len(hits)}
        return report


class DedupStage(Stage):
    name = "dedup"

    def enabled(self, policy: Policy) -> bool:
        return policy.dedup.enabled

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        policy = ctx.policy.dedup
        report = StageReport(self.name)
        if not state.passages:
            return report
        before = passages_tokens(ctx.counter, state.passages)
        near = policy.near_duplicate_cosine
        embedder = ctx.services.embedder if near is not None else None
        texts = [passage_text_for_scoring(p) for p in state.passages]
        vectors = None
        if embedder is not None:
            ensure_candidates(ctx, state)
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


class RerankStage(Stage):
    name = "rerank"

    def enabled(self, policy: Policy) -> bool:
        return policy.rerank.enabled

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
        scores = self.reranker(ctx).score(state.question_text, state.passages)
        for passage, score in zip(state.passages, scores, strict=True):
            passage.score = float(score)
        ranked = sorted(state.passages, key=lambda p: (-p.score, p.position))
        if policy.min_score is not None:
            ranked = [p for p in ranked if p.score >= policy.min_score]
        limit = min(policy.top_k or len(ranked), ctx.policy.documents.max_documents or len(ranked))
        kept = {id(p) for p in ranked[:limit]}
        state.passages = [p for p in state.passages if id(p) in kept]
        report.details["kept"] = len(state.passages)
        report.saved_tokens = before - passages_tokens(ctx.counter, state.passages)
        return report


class ExtractionStage(Stage):
    name = "extraction"

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        report = StageReport(self.name)
        if not state.passages:
            return report
        policy = ctx.policy.extraction
        budget = documents_budget(state, ctx)
        keep_titles = policy.keep_titles
        report.details["budget"] = budget
        before = passages_tokens(ctx.counter, state.passages)
        if ctx.counter.count(render_context(state.passages, keep_titles)) <= budget:
            return report
        if policy.enabled and policy.unit == "sentence":
            ensure_candidates(ctx, state)
            units = score_sentences(
                state.question_text,
                ctx.question_vector(state),
                state.passages,
                ctx.services.embedder.embed,
                policy.expand_query,
            )
            select_sentences(
                units,
                state.passages,
                budget,
                ctx.counter.count,
                ctx.counter.count_many,
                policy.neighbours,
                keep_titles,
            )
        else:
            select_passages(state.passages, budget, ctx.counter, keep_titles)
        state.passages = [p for p in state.passages if not p.is_empty()]
        report.saved_tokens = before - passages_tokens(ctx.counter, state.passages)
        return report


def documents_budget(state: PipelineState, ctx: StageContext) -> int:
    remaining = state.budget_tokens - state.pinned_tokens - history_tokens(ctx.counter, state)
    return max(0, min(ctx.policy.documents.max_tokens, remaining))


def select_passages(passages: list[Passage], budget: int, counter: CachedCounter, keep_titles: bool) -> None:
    """Whole-passage knapsack (extraction unit 'passage' or extraction disabled)."""
    from compression.rendering import render_passage

    costs = [counter.count(render_passage(i + 1, p, keep_titles)) + 2 for i, p in enumerate(passages)]
    values = values_from_scores(np.array([p.score for p in passages], dtype=np.float64))
    chosen = set(knapsack(list(values), costs, budget))
    for index, passage in enumerate(passages):
        if index not in chosen:
            passage.sentences = [passage.text]
            passage.kept_sentences = []
    trim_block_to_budget(passages, budget, counter.count, keep_titles)


class AssemblyStage(Stage):
    """Orders the kept passages and builds the messages; the exact fit is checked by the pipeline."""

    name = "assembly"

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        state.passages = order_passages(state.passages, ctx.policy.assembly.order)
        return StageReport(self.name, details={"order": ctx.policy.assembly.order})


STAGE_REGISTRY: dict[str, type[Stage]] = {
    stage.name: stage
    for stage in (HistoryStage, RetrievalStage, DedupStage, RerankStage, ExtractionStage, AssemblyStage)
}
STAGE_ORDER = ("history", "retrieval", "dedup", "rerank", "extraction", "assembly")


def timed(report: StageReport, started: float) -> StageReport:
    report.ms = (time.perf_counter() - started) * 1000
    return report


__all__ = ["STAGE_ORDER", "STAGE_REGISTRY", "Stage", "StageContext", "drop_lowest_sentence", "timed"]
