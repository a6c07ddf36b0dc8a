"""The extraction stage: the passages block is cut to its budget, best sentences by a knapsack (or
whole passages).

Rule: the rendered passages block fits `documents_budget` (what the documents' cap, the pinned
parts and the kept history leave); nothing is cut when it already fits.
"""

from __future__ import annotations

import numpy as np

from ctxgate.compression.counting import CachedCounter
from ctxgate.compression.extraction import score_sentences, select_sentences, trim_block_to_budget
from ctxgate.compression.knapsack import knapsack
from ctxgate.compression.rendering import render_context, render_passage
from ctxgate.compression.scoring import values_from_scores
from ctxgate.compression.stages.base import Stage, StageContext
from ctxgate.compression.stages.budget import documents_budget, passages_tokens
from ctxgate.compression.stages.prepare import ensure_candidates
from ctxgate.compression.state import Passage, PipelineState
from ctxgate.compression.types import StageReport
from ctxgate.policies.schema import ExtractionPolicy


class ExtractionStage(Stage):
    """The passages block is cut to its budget: best sentences by a knapsack (or whole passages)."""

    name = "extraction"

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        report = StageReport(self.name)
        if not state.passages:
            return report
        policy = ctx.policy.extraction
        budget = documents_budget(state, ctx)
        report.details["budget"] = budget
        before = passages_tokens(ctx.counter, state.passages)
        # The rendered block is every body plus its headers: when the bodies alone are over the
        # budget it cannot fit, and counting it (a first sight's whole context) would only say so.
        if (
            before <= budget
            and ctx.counter.count(render_context(state.passages, policy.keep_titles)) <= budget
        ):
            return report
        if policy.enabled and policy.unit == "sentence":
            ensure_candidates(ctx, state)
            question_vector = ctx.question_vector(state)
            embed = ctx.services.embedder.embed
            units = score_sentences(state.question_text, question_vector, state.passages, embed, policy)
            select_sentences(units, state.passages, budget, ctx.counter, policy)
        else:
            select_passages(state.passages, budget, ctx.counter, policy)
        state.passages = [p for p in state.passages if not p.is_empty()]
        report.saved_tokens = before - passages_tokens(ctx.counter, state.passages)
        return report


def select_passages(
    passages: list[Passage], budget: int, counter: CachedCounter, policy: ExtractionPolicy
) -> None:
    """Whole-passage knapsack (extraction unit 'passage' or extraction disabled)."""
    costs = [counter.count(render_passage(i + 1, p, policy.keep_titles)) + 2 for i, p in enumerate(passages)]
    values = values_from_scores(np.array([p.score for p in passages], dtype=np.float64))
    chosen = set(knapsack(list(values), costs, budget))
    for index, passage in enumerate(passages):
        if index not in chosen:
            passage.sentences = [passage.text]
            passage.kept_sentences = []
    trim_block_to_budget(passages, budget, counter, policy)
