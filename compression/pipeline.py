"""The compression pipeline the gateway calls.

    pipeline = CompressionPipeline(tokenizer, engine=None, cache=None, index_dir=None)
    result = await pipeline.run(CompressionInput(...), policy)

Guarantee: `result.prompt_tokens == tokenizer.count_chat(result.messages) <= policy.max_input_tokens`,
with every system message and the question verbatim; when those alone do not fit,
`BudgetExceededError` is raised instead.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from compression.cache import BytesCache, LRUBytesCache
from compression.counting import CachedCounter, TokenCounter
from compression.extraction import drop_lowest_sentence
from compression.history import HistorySummarizer
from compression.index import IndexStore
from compression.rendering import order_passages, render_context, render_messages
from compression.stages import (
    STAGE_ORDER,
    STAGE_REGISTRY,
    RetrievalStage,
    StageContext,
    history_tokens,
    passages_tokens,
    timed,
    turn_cost,
)
from compression.state import PipelineState, split_messages
from compression.types import BudgetExceededError, CompressionInput, CompressionResult, Document, StageReport
from policies.schema import Policy


class PrefillCostEstimator:
    """Milliseconds of prefill per prompt token, fed from the engine's own request metrics.

    An exponentially weighted average, so it follows load changes; also tracks how long
    compression itself takes, since a cut that costs more than it saves does not pay.
    """

    def __init__(self, ms_per_token: float = 0.5, smoothing: float = 0.1):
        self.ms_per_token = ms_per_token
        self.compression_ms = 0.0
        self.smoothing = smoothing
        self._lock = threading.Lock()

    def observe_prefill(self, prompt_tokens: int, prefill_ms: float) -> None:
        if prompt_tokens <= 0 or prefill_ms <= 0:
            return
        with self._lock:
            sample = prefill_ms / prompt_tokens
            self.ms_per_token += self.smoothing * (sample - self.ms_per_token)

    def observe_compression(self, compression_ms: float) -> None:
        with self._lock:
            self.compression_ms += self.smoothing * (compression_ms - self.compression_ms)

    def net_saving_ms(self, saved_tokens: int) -> float:
        return saved_tokens * self.ms_per_token - self.compression_ms


class Services:
    """Shared, lazily created helpers (the embedding model loads on first use)."""

    def __init__(
        self, counter: CachedCounter, tokenizer: Any, engine: Any, cache: BytesCache, index_dir: Any
    ):
        from compression.text import default_splitter

        self.counter = counter
        self.tokenizer = tokenizer
        self.engine = engine
        self.cache = cache
        self.splitter = default_splitter()
        self.index_store = IndexStore(index_dir)
        self.summarizer = HistorySummarizer(counter.count, self.splitter.split, cache, engine, tokenizer)
        self._embedder = None
        self._llm_reranker = None
        self._lock = threading.Lock()

    @property
    def embedder(self) -> Any:
        if self._embedder is None:
            with self._lock:
                if self._embedder is None:
                    from compression.embeddings import shared_embedder

                    self._embedder = shared_embedder(self.cache)
        return self._embedder

    def llm_reranker(self) -> Any:
        if self._llm_reranker is None:
            from compression.llm_score import LLMReranker

            self._llm_reranker = LLMReranker.from_tokenizer(self.tokenizer)
        return self._llm_reranker


class CompressionPipeline:
    def __init__(
        self,
        tokenizer: TokenCounter,
        engine: Any = None,
        cache: BytesCache | None = None,
        index_dir: str | Path | None = None,
        cost_estimator: PrefillCostEstimator | None = None,
    ):
        self.tokenizer = tokenizer
        self.counter = CachedCounter(tokenizer)
        self.cache = cache if cache is not None else LRUBytesCache()
        self.services = Services(self.counter, tokenizer, engine, self.cache, index_dir)
        self.cost_estimator = cost_estimator or PrefillCostEstimator()
        self.stages = {name: cls() for name, cls in STAGE_REGISTRY.items()}

    @property
    def engine(self) -> Any:
        return self.services.engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        self.services.engine = engine
        self.services.summarizer.engine = engine

    async def run(self, request: CompressionInput, policy: Policy) -> CompressionResult:
        started = time.perf_counter()
        state = split_messages(request)
        ctx = StageContext(policy=policy, counter=self.counter, services=self.services)
        budget = policy.max_input_tokens
        state.budget_tokens = budget

        reports: dict[str, StageReport] = {}
        if state.retrieval is not None:
            # Retrieval does not depend on history, so it runs first: the original prompt (and the
            # cost check) must include the retrieved passages.
            stage_started = time.perf_counter()
            reports["retrieval"] = timed(await RetrievalStage().run(state, ctx), stage_started)

        original_history = list(state.history)
        original_messages = render_messages(
            state,
            render_context(order_passages(state.passages, "original")),
            original_history,
            None,
            policy.assembly,
        )
        original_tokens = self.counter.count_chat(original_messages)
        pinned_messages = render_messages(state, "", [], None, policy.assembly)
        state.pinned_tokens = self.counter.count_chat(pinned_messages)
        if state.pinned_tokens > budget:
            raise BudgetExceededError(
                f"the system prompt and question alone take {state.pinned_tokens} tokens, "
                f"over the budget of {budget} (max_input_tokens)",
                required_tokens=state.pinned_tokens,
                budget_tokens=budget,
            )
        if state.passages:
            with_header = render_messages(state, "x", [], None, policy.assembly)
            state.pinned_tokens = self.counter.count_chat(with_header) - 1

        skip_reason = self._skip_reason(state, ctx, original_tokens)
        if skip_reason is not None:
            if original_tokens > budget:
                raise BudgetExceededError(
                    f"the prompt takes {original_tokens} tokens, over the budget of {budget}, "
                    "and this policy disables compression",
                    required_tokens=original_tokens,
                    budget_tokens=budget,
                )
            state.passages = order_passages(state.passages, "original")
            result = self._result(
                original_messages, original_tokens, original_tokens, state, list(reports.values())
            )
            result.stages.append(StageReport("cost-check", details={"skipped": skip_reason}))
            return result

        state.history_budget = max(0, min(policy.history.max_tokens, budget - state.pinned_tokens))
        for name in STAGE_ORDER:
            if name in reports or (name == "retrieval" and state.retrieval is None):
                continue
            stage = self.stages[name]
            if not stage.enabled(policy):
                continue
            stage_started = time.perf_counter()
            reports[name] = timed(await stage.run(state, ctx), stage_started)
        ordered = [reports[name] for name in STAGE_ORDER if name in reports]

        assembly_started = time.perf_counter()
        messages, prompt_tokens, trimmed = self._fit(state, ctx)
        assembly = reports.get("assembly")
        if assembly is not None:
            assembly.ms += (time.perf_counter() - assembly_started) * 1000
            assembly.details["trimmed_units"] = trimmed
            # The exact total reconciles the per-stage estimates (template, BPE merges, trims).
            assembly.saved_tokens = (
                original_tokens - prompt_tokens - sum(r.saved_tokens for r in ordered if r is not assembly)
            )
        result = self._result(
            messages, original_tokens, prompt_tokens, state, ordered, policy.extraction.keep_titles
        )
        self.cost_estimator.observe_compression((time.perf_counter() - started) * 1000)
        return result

    def _skip_reason(self, state: PipelineState, ctx: StageContext, original_tokens: int) -> str | None:
        policy = ctx.policy
        if not policy.compression_enabled:
            return "compression disabled by policy"
        if policy.min_saving_ms <= 0 or original_tokens > policy.max_input_tokens:
            return None
        # Upper bound of what the budgets force out; if even that does not pay, do nothing.
        history_now = history_tokens(self.counter, state)
        documents_now = passages_tokens(self.counter, state.passages)
        history_kept = min(history_now, policy.history.max_tokens)
        documents_kept = min(documents_now, policy.documents.max_tokens)
        forced_saving = max(0, history_now - history_kept) + max(0, documents_now - documents_kept)
        if policy.rerank.enabled and policy.rerank.top_k and len(state.passages) > policy.rerank.top_k:
            forced_saving = max(
                forced_saving,
                documents_now // len(state.passages) * (len(state.passages) - policy.rerank.top_k),
            )
        net_ms = self.cost_estimator.net_saving_ms(forced_saving)
        if net_ms < policy.min_saving_ms:
            return f"estimated saving {net_ms:.1f} ms < min_saving_ms {policy.min_saving_ms}"
        return None

    def _fit(self, state: PipelineState, ctx: StageContext) -> tuple[list[dict[str, Any]], int, int]:
        """Exact check of the final prompt; drop the least valuable units until it fits."""
        policy = ctx.policy
        keep_titles = policy.extraction.keep_titles
        trimmed = 0
        # The passages block keeps its own cap exactly (numbering and order can shift a token).
        while (
            state.passages
            and self.counter.count(render_context(state.passages, keep_titles)) > policy.documents.max_tokens
        ):
            if drop_lowest_sentence(state.passages) is None:
                break
            trimmed += 1
        while True:
            passages = [p for p in state.passages if not p.is_empty()]
            messages = render_messages(
                state, render_context(passages, keep_titles), state.history, state.summary, policy.assembly
            )
            tokens = self.counter.count_chat(messages)
            if tokens <= state.budget_tokens:
                return messages, tokens, trimmed
            # Drop units worth at least the excess (estimated), then count exactly again.
            excess = tokens - state.budget_tokens
            while excess > 0:
                removed = self._drop_one(state)
                if removed is None:
                    raise BudgetExceededError(
                        f"prompt of {tokens} tokens cannot fit the budget of {state.budget_tokens}",
                        required_tokens=tokens,
                        budget_tokens=state.budget_tokens,
                    )
                trimmed += 1
                excess -= max(1, removed)

    def _drop_one(self, state: PipelineState) -> int | None:
        """Least valuable unit first: history over its budget loses its oldest turn, otherwise the
        lowest-scored passage sentence goes, then the summary, then the oldest turns."""
        over_history = history_tokens(self.counter, state) > state.history_budget
        if over_history and state.history:
            return turn_cost(self.counter, state.history.pop(0))
        if over_history and state.summary:
            cost = self.counter.count(state.summary)
            state.summary = None
            return cost
        dropped = drop_lowest_sentence(state.passages)
        if dropped is not None:
            return self.counter.count(dropped) + 1
        if state.summary:
            cost = self.counter.count(state.summary)
            state.summary = None
            return cost
        if state.history:
            return turn_cost(self.counter, state.history.pop(0))
        return None

    def _result(
        self,
        messages: list[dict[str, Any]],
        original_tokens: int,
        prompt_tokens: int,
        state: PipelineState,
        stages: list[StageReport],
        keep_titles: bool = True,
    ) -> CompressionResult:
        passages = [p for p in state.passages if not p.is_empty()]
        return CompressionResult(
            messages=messages,
            original_prompt_tokens=original_tokens,
            prompt_tokens=prompt_tokens,
            stages=stages,
            kept_documents=[
                Document(text=p.body(), id=p.document.id, title=p.title, score=p.score) for p in passages
            ],
            context_text=render_context(passages, keep_titles),
        )
