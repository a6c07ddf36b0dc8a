"""The compression pipeline the gateway calls.

    pipeline = CompressionPipeline(tokenizer, engine=None, cache=None, index_dir=None)
    result = await pipeline.run(CompressionInput(...), policy)

Guarantee: `result.prompt_tokens == tokenizer.count_chat(result.messages) <= policy.max_input_tokens`,
with every system message and the question verbatim; when those alone do not fit,
`BudgetExceededError` is raised instead. The algorithm is the ordered list `compression.stages.STAGES`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from compression.cache import BytesCache, LRUBytesCache
from compression.counting import CachedCounter, TokenCounter
from compression.message_context import report_kept
from compression.rendering import render_context
from compression.services import PrefillCostEstimator, Services
from compression.stages import STAGES, Stage, StageContext, run_timed
from compression.state import PipelineState, split_messages
from compression.types import CompressionInput, CompressionResult, Document, StageReport
from policies.schema import Policy

__all__ = ["CompressionPipeline", "PrefillCostEstimator"]


class CompressionPipeline:
    def __init__(
        self,
        tokenizer: TokenCounter,
        engine: Any = None,
        cache: BytesCache | None = None,
        index_dir: str | Path | None = None,
        cost_estimator: PrefillCostEstimator | None = None,
        stages: tuple[Stage, ...] = STAGES,
    ):
        self.tokenizer = tokenizer
        self.counter = CachedCounter(tokenizer)
        self.cache = cache if cache is not None else LRUBytesCache()
        self.cost_estimator = cost_estimator or PrefillCostEstimator()
        self.services = Services(self.counter, tokenizer, engine, self.cache, index_dir, self.cost_estimator)
        self.stages = stages

    @property
    def engine(self) -> Any:
        return self.services.engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        self.services.engine = engine
        self.services.summarizer.engine = engine

    async def run(self, request: CompressionInput, policy: Policy) -> CompressionResult:
        started = time.perf_counter()
        state = split_messages(request, budget_tokens=policy.max_input_tokens)
        ctx = StageContext(policy=policy, counter=self.counter, services=self.services)
        reports: list[StageReport] = []
        for stage in self.stages:
            if stage.enabled(state, policy):
                reports.append(await run_timed(stage, state, ctx))
        if state.compressing:
            self.cost_estimator.observe_compression((time.perf_counter() - started) * 1000)
        report_kept(state, reports, self.counter)
        return result_of(state, reports, policy)


def result_of(state: PipelineState, reports: list[StageReport], policy: Policy) -> CompressionResult:
    assert state.original is not None and state.sent is not None, "the cost check and the fit always run"
    reconcile_savings(reports, state.original.tokens - state.sent.tokens)
    # The original prompt keeps every title; a compressed one keeps them as the policy says.
    keep_titles = policy.extraction.keep_titles if state.compressing else True
    passages = [p for p in state.passages if not p.is_empty()]
    return CompressionResult(
        messages=state.sent.messages,
        original_prompt_tokens=state.original.tokens,
        prompt_tokens=state.sent.tokens,
        stages=reports,
        kept_documents=[
            Document(text=p.body(), id=p.document.id, title=p.title, score=p.score) for p in passages
        ],
        context_text=render_context(passages, keep_titles),
    )


def reconcile_savings(reports: list[StageReport], saved_exactly: int) -> None:
    """Stages estimate their savings from per-unit counts; the last report (the fit, the one exact
    count) takes the remainder, so the reports add up to exactly what was saved."""
    reports[-1].saved_tokens = saved_exactly - sum(report.saved_tokens for report in reports[:-1])
