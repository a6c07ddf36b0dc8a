"""The pipeline's stages, in the one ordered list `STAGES` that `CompressionPipeline` runs.

    retrieval -> message-context -> cost-check -> history -> dedup -> rerank -> extraction -> assembly -> fit

Each stage is a small class configured by its policy section: `enabled(state, policy)` says whether
it runs for this request, `run(state, ctx)` reads and writes the typed `PipelineState` and returns a
`StageReport` with the tokens it removed. Stage estimates come from cached per-unit counts; the fit
stage checks the exact count of the final prompt. When the cost check decides compressing does not
pay (or the policy disables it), the compressing stages stand aside and the fit sends the original.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from compression.counting import CachedCounter
from compression.dedup import duplicate_indices
from compression.extraction import (
    drop_lowest_sentence,
    score_sentences,
    second_hop,
    select_sentences,
    trim_block_to_budget,
    values_from_scores,
)
from compression.history import is_tool_unit, turn_units
from compression.knapsack import knapsack
from compression.message_context import lift_context
from compression.multihop import first_hop_passage_sentences, named_passages, plan_second_hop
from compression.prefilter import mark_embedding_candidates
from compression.rendering import (
    SUMMARY_HEADER,
    order_passages,
    render_context,
    render_messages,
    render_passage,
    render_slots,
    summary_text,
)
from compression.rerank import (
    BM25Reranker,
    CrossEncoderReranker,
    EmbeddingReranker,
    FusedReranker,
    Reranker,
    passage_embedding_texts,
    passage_text_for_scoring,
    passage_vectors,
    refine_untitled,
)
from compression.services import Services
from compression.state import Passage, PipelineState, RenderedPrompt, message_text
from compression.types import BudgetExceededError, Document, StageReport
from policies.schema import ExtractionPolicy, Policy

MESSAGE_FRAMING_TOKENS = 5  # role + start/end markers around one chat message (estimate)
MIN_SUMMARY_TOKENS = 8  # below this a summary says nothing: the older turns are dropped instead


@dataclass
class StageContext:
    """What a stage may use besides the state: the request's policy and the shared services."""

    policy: Policy
    counter: CachedCounter
    services: Services

    def question_vector(self, state: PipelineState) -> np.ndarray:
        if state.question_vector is None:
            state.question_vector = self.services.embedder.embed([state.question_text])[0]
        return state.question_vector


def turn_cost(counter: CachedCounter, message: dict[str, Any]) -> int:
    cost = counter.count(message_text(message)) + MESSAGE_FRAMING_TOKENS
    calls = message.get("tool_calls") or message.get("function_call")
    if calls:  # the call's name and arguments are sent too
        cost += counter.count(json.dumps(calls, ensure_ascii=False))
    return cost


def history_tokens(counter: CachedCounter, state: PipelineState) -> int:
    total = sum(turn_cost(counter, m) for m in state.history)
    if state.summary:
        total += counter.count(summary_text(state.summary)) + MESSAGE_FRAMING_TOKENS
    return total


def passages_tokens(counter: CachedCounter, passages: list[Passage]) -> int:
    """The passages' bodies in tokens, as the stages price them: a split passage is the sum of its
    sentences (each text counted once and cached), so a body that dedup or extraction changed is
    not tokenized again. Within a token or two of counting the joined body; the stages' savings are
    estimates anyway, and the fit's exact count of the prompt reconciles them."""
    texts: list[str] = []
    for passage in passages:
        texts.extend([passage.body()] if passage.sentences is None else passage.body_sentences())
    return sum(counter.count_many([text for text in texts if text.strip()]))


def documents_budget(state: PipelineState, ctx: StageContext) -> int:
    remaining = state.budget_tokens - state.pinned_tokens - history_tokens(ctx.counter, state)
    return max(0, min(ctx.policy.documents.max_tokens, remaining))


def ensure_sentences(ctx: StageContext, passages: list[Passage]) -> None:
    for passage in passages:
        if passage.sentences is None:
            passage.sentences = ctx.services.splitter.split(passage.text) or [passage.text]


def ensure_candidates(ctx: StageContext, state: PipelineState) -> None:
    """Run the lexical pre-filter once per request, before anything is embedded."""
    if state.prefiltered or state.retrieval is not None:
        return  # retrieved passages bring their vectors from the index: embedding them is free
    state.prefiltered = True
    ensure_sentences(ctx, state.passages)
    documents = ctx.policy.documents
    mark_embedding_candidates(
        state.question_text, state.passages, documents_budget(state, ctx),
        documents.embed_budget_multiple, documents.embed_min_share,
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


class Stage(ABC):
    name: ClassVar[str]

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        """Compressing stages run unless the cost check decided to send the original."""
        return state.compressing

    @abstractmethod
    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport: ...


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
            document = Document(text=clean(document.text), id=document.id, score=document.score,
                                title=None if document.title is None else clean(document.title))
            passage = Passage(document=document, position=first_position + rank, score=score)
            passage.sentences = sentences
            state.passages.append(passage)
        return StageReport(self.name, details={"index": state.retrieval.index, "retrieved": len(hits)})


class MessageContextStage(Stage):
    """Retrieved context rendered inside the system/user messages becomes passages for the stages
    below; the renderer puts what is kept back where it was (compression/message_context.py)."""

    name = "message-context"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        return policy.documents.from_messages

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        lifted = lift_context(state)
        if not lifted:
            return StageReport(self.name, details={"passages_found": 0, "tokens_found": 0})
        passages = [p for p in state.passages if p.frame is not None]
        details: dict[str, Any] = {
            "message": ", ".join(dict.fromkeys(where for where, _ in lifted)),
            "layout": ", ".join(dict.fromkeys(found.layout for _, found in lifted)),
            "passages_found": len(passages), "tokens_found": passages_tokens(ctx.counter, passages),
        }
        if len(lifted) > 1:
            details["blocks"] = [{"message": where, "layout": found.layout, "passages": len(found.passages)}
                                 for where, found in lifted]
        return StageReport(self.name, details=details)


class CostCheckStage(Stage):
    """Measures the original prompt and the parts never cut, refuses (413) when those alone are over
    budget, and decides whether compressing pays for itself."""

    name = "cost-check"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        return True

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        state.original = render_original(state, ctx)
        state.pinned_tokens = pinned_tokens(state, ctx)
        state.skip_reason = self.skip_reason(state, ctx)
        if state.skip_reason is not None:
            return StageReport(self.name, details={"skipped": state.skip_reason})
        policy = ctx.policy
        state.history_budget = max(0, min(policy.history.max_tokens, state.budget_tokens - state.pinned_tokens))
        return StageReport(self.name)

    def skip_reason(self, state: PipelineState, ctx: StageContext) -> str | None:
        policy = ctx.policy
        assert state.original is not None
        if not policy.compression_enabled:
            return "compression disabled by policy"
        if policy.min_saving_ms <= 0 or state.original.tokens > policy.max_input_tokens:
            return None
        net_ms = ctx.services.cost_estimator.net_saving_ms(forced_saving(state, ctx))
        if net_ms < policy.min_saving_ms:
            return f"estimated saving {net_ms:.1f} ms < min_saving_ms {policy.min_saving_ms}"
        return None


def render_original(state: PipelineState, ctx: StageContext) -> RenderedPrompt:
    """Every document inline (request order, titles kept) and the full history."""
    passages = order_passages(state.passages, "original")
    context_text = render_context(passages)
    slot_texts = render_slots(passages) if state.context_slots else None
    messages = render_messages(state, context_text, list(state.history), None, ctx.policy.assembly, slot_texts)
    return RenderedPrompt(messages, ctx.counter.count_chat(messages))


def pinned_tokens(state: PipelineState, ctx: StageContext) -> int:
    """Tokens of what is never cut; `BudgetExceededError` when that alone is over the budget."""
    assembly = ctx.policy.assembly
    pinned = ctx.counter.count_chat(render_messages(state, "", [], None, assembly))
    if pinned > state.budget_tokens:
        raise BudgetExceededError(
            f"the system prompt and question alone take {pinned} tokens, "
            f"over the budget of {state.budget_tokens} (max_input_tokens)",
            required_tokens=pinned,
            budget_tokens=state.budget_tokens,
        )
    if state.passages:
        # With passages the context block's own framing is pinned too: measured around a 1-token block.
        pinned = ctx.counter.count_chat(render_messages(state, "x", [], None, assembly)) - 1
    return pinned


def forced_saving(state: PipelineState, ctx: StageContext) -> int:
    """Upper bound of what the budgets force out; if even that does not pay, do nothing."""
    policy = ctx.policy
    history_now = history_tokens(ctx.counter, state)
    documents_now = passages_tokens(ctx.counter, state.passages)
    history_kept = min(history_now, policy.history.max_tokens)
    documents_kept = min(documents_now, policy.documents.max_tokens)
    saving = max(0, history_now - history_kept) + max(0, documents_now - documents_kept)
    if policy.rerank.enabled and policy.rerank.top_k and len(state.passages) > policy.rerank.top_k:
        per_passage = documents_now // len(state.passages)
        saving = max(saving, per_passage * (len(state.passages) - policy.rerank.top_k))
    return saving


class HistoryStage(Stage):
    """Older turns over the history budget are summarized (or dropped); the last ones stay verbatim.

    A tool exchange (an assistant turn with `tool_calls` and its `tool` replies) is one unit, kept
    verbatim or dropped whole, never summarized or split: a summary cannot stand in for the calls
    and results a model (or the client's agent loop) refers back to, and a call without its replies
    (or replies without their call) is a conversation an OpenAI-style server refuses. Older tool
    exchanges are kept before the summary gets any room; one that cannot fit is dropped whole and
    counted in the report (`tool_exchanges_dropped`)."""

    name = "history"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        return state.compressing and policy.history.enabled

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        before = history_tokens(ctx.counter, state)
        budget = state.history_budget
        report = StageReport(self.name, details={"turns": len(state.history), "budget": budget})
        if before <= budget:
            return report
        costs = [turn_cost(ctx.counter, m) for m in state.history]
        units = turn_units(state.history)
        unit_costs = [sum(costs[start:end]) for start, end in units]
        if ctx.policy.history.strategy == "truncate":
            keep_from = oldest_kept_turn(unit_costs, budget)
            kept = set(range(keep_from, len(units)))
            report.details["dropped_turns"] = units[keep_from][0] if keep_from < len(units) else len(state.history)
        else:
            kept = await self.summarize_older_turns(state, ctx, units, unit_costs, report)
        tool_units = [u for u, unit in enumerate(units) if is_tool_unit(state.history, unit)]
        if tool_units:
            report.details["tool_exchanges_kept"] = sum(u in kept for u in tool_units)
            report.details["tool_exchanges_dropped"] = sum(u not in kept for u in tool_units)
        state.history = [m for u in sorted(kept) for m in state.history[units[u][0]:units[u][1]]]
        report.saved_tokens = before - history_tokens(ctx.counter, state)
        return report

    async def summarize_older_turns(
        self,
        state: PipelineState,
        ctx: StageContext,
        units: list[tuple[int, int]],
        unit_costs: list[int],
        report: StageReport,
    ) -> set[int]:
        """Summarize the older plain turns into `state.summary`; return the units kept verbatim."""
        policy = ctx.policy.history
        budget = state.history_budget
        # The last `keep_last_turns` turns stay verbatim (widened to whole units)...
        tail_start = max(0, len(state.history) - policy.keep_last_turns)
        tail = next((u for u, (_, end) in enumerate(units) if end > tail_start), len(units))
        while tail < len(units) and sum(unit_costs[tail:]) > budget:
            tail += 1  # even the kept turns must fit the promise
        kept = set(range(tail, len(units)))
        spent = sum(unit_costs[tail:])
        # ...and so do the older tool exchanges, newest first, while they fit.
        for u in reversed(range(tail)):
            if is_tool_unit(state.history, units[u]) and spent + unit_costs[u] <= budget:
                kept.add(u)
                spent += unit_costs[u]
        older = [
            message
            for u in range(tail)
            if u not in kept and not is_tool_unit(state.history, units[u])
            for message in state.history[units[u][0]:units[u][1]]
        ]
        # The header, the turn's framing and the quote mark (+ the newline) around the summary.
        summary_overhead = ctx.counter.count(SUMMARY_HEADER + "\n> ") + MESSAGE_FRAMING_TOKENS + 1
        summary_budget = min(policy.summary_max_tokens, budget - spent - summary_overhead)
        summary = None
        if older and summary_budget >= MIN_SUMMARY_TOKENS:
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
                summary_source=outcome.source, engine_calls=outcome.engine_calls, summarized_turns=len(older)
            )
        state.summary = summary
        return kept


def oldest_kept_turn(costs: list[int], budget: int) -> int:
    """Index of the oldest turn kept when the newest turns that fit `budget` are kept."""
    keep_from = len(costs)
    spent = 0
    while keep_from > 0 and spent + costs[keep_from - 1] <= budget:
        keep_from -= 1
        spent += costs[keep_from]
    return keep_from


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
        limit = min(policy.top_k or len(state.passages), ctx.policy.documents.max_documents or len(state.passages))
        scores = refine_untitled(reranker, state.question_text, state.passages, scores, limit)
        for passage, score in zip(state.passages, scores, strict=True):
            passage.score = float(score)
        ranked = sorted(state.passages, key=lambda p: (-p.score, p.position))
        if policy.min_score is not None:
            ranked = [p for p in ranked if p.score >= policy.min_score]
        limit = min(limit, len(ranked))
        kept = {id(p) for p in ranked[:limit]}
        if ctx.policy.extraction.second_hop == "auto":
            bridges = rerank_bridges(state, ctx, ranked, limit)
            kept |= {id(p) for p in bridges}
            report.details["bridges_kept"] = len(bridges)
        state.passages = [p for p in state.passages if id(p) in kept]
        report.details["kept"] = len(state.passages)
        report.saved_tokens = before - passages_tokens(ctx.counter, state.passages)
        return report


# Passages read for bridge entities before sentence scores exist (the extraction decides for good).
RERANK_HOP_PASSAGES = 2
# Bridges kept past the cut: one more than the extraction follows (keeping a passage is cheap, and
# the extraction's sentence scores choose better than the rerank's passage scores).
RERANK_BRIDGES = 3
# Passages the question names kept past the cut, at most.
RERANK_NAMED = 1


def rerank_bridges(state: PipelineState, ctx: StageContext, ranked: list[Passage], limit: int) -> list[Passage]:
    """Passages below the rerank cut that a multi-hop question's first hop names: the bridge ranks
    low by nature (it shares little with the question), so the cut must not drop it."""
    if limit >= len(ranked):
        return []
    ensure_sentences(ctx, ranked[:RERANK_HOP_PASSAGES])
    order = list(range(len(ranked)))
    hop = plan_second_hop(
        state.question_text, ranked, first_hop_passage_sentences(ranked, order, RERANK_HOP_PASSAGES),
        max_bridges=RERANK_BRIDGES,
    )
    bridges = [ranked[index] for index in hop.bridges if index >= limit] if hop.triggered else []
    # A passage the question names by title is where the question starts (a first hop of its own,
    # compression.multihop.named_passages), however little else of the question it shares.
    named = [ranked[index] for index in named_passages(state.question_text, ranked) if index >= limit]
    return bridges + [p for p in named[:RERANK_NAMED] if p not in bridges]


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
        if before <= budget and ctx.counter.count(render_context(state.passages, policy.keep_titles)) <= budget:
            return report
        if policy.enabled and policy.unit == "sentence":
            ensure_candidates(ctx, state)
            question_vector = ctx.question_vector(state)
            embed = ctx.services.embedder.embed
            units = score_sentences(state.question_text, question_vector, state.passages, embed, policy)
            if policy.second_hop == "auto":
                report.details.update(second_hop(state.question_text, units, state.passages, embed).details())
            select_sentences(units, state.passages, budget, ctx.counter, policy)
        else:
            select_passages(state.passages, budget, ctx.counter, policy)
        state.passages = [p for p in state.passages if not p.is_empty()]
        report.saved_tokens = before - passages_tokens(ctx.counter, state.passages)
        return report


def select_passages(passages: list[Passage], budget: int, counter: CachedCounter, policy: ExtractionPolicy) -> None:
    """Whole-passage knapsack (extraction unit 'passage' or extraction disabled)."""
    costs = [counter.count(render_passage(i + 1, p, policy.keep_titles)) + 2 for i, p in enumerate(passages)]
    values = values_from_scores(np.array([p.score for p in passages], dtype=np.float64))
    chosen = set(knapsack(list(values), costs, budget))
    for index, passage in enumerate(passages):
        if index not in chosen:
            passage.sentences = [passage.text]
            passage.kept_sentences = []
    trim_block_to_budget(passages, budget, counter, policy)


class AssemblyStage(Stage):
    """Orders the kept passages against "lost in the middle"; the fit stage renders them."""

    name = "assembly"

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        state.passages = order_passages(state.passages, ctx.policy.assembly.order)
        return StageReport(self.name, details={"order": ctx.policy.assembly.order})


class FitStage(Stage):
    """Renders the prompt and counts it exactly; drops the least valuable units until it fits.

    When the cost check skipped compression, the original prompt is sent if it fits the budget and
    refused (`BudgetExceededError`) otherwise.
    """

    name = "fit"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        return True

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        if not state.compressing:
            send_original(state)
            return StageReport(self.name)
        state.trimmed_units = cap_passages_block(state, ctx)
        while True:
            state.sent = render_sent(state, ctx)
            if state.sent.tokens <= state.budget_tokens:
                return StageReport(self.name, details={"trimmed_units": state.trimmed_units})
            # Drop units worth at least the excess (estimated), then count exactly again.
            excess = state.sent.tokens - state.budget_tokens
            while excess > 0:
                removed = drop_least_valuable_unit(state, ctx.counter)
                if removed is None:
                    raise BudgetExceededError(
                        f"prompt of {state.sent.tokens} tokens cannot fit the budget of {state.budget_tokens}",
                        required_tokens=state.sent.tokens,
                        budget_tokens=state.budget_tokens,
                    )
                state.trimmed_units += 1
                excess -= max(1, removed)


def send_original(state: PipelineState) -> None:
    assert state.original is not None
    if state.original.tokens > state.budget_tokens:
        raise BudgetExceededError(
            f"the prompt takes {state.original.tokens} tokens, over the budget of {state.budget_tokens}, "
            "and this policy disables compression",
            required_tokens=state.original.tokens,
            budget_tokens=state.budget_tokens,
        )
    state.passages = order_passages(state.passages, "original")
    state.sent = state.original


def cap_passages_block(state: PipelineState, ctx: StageContext) -> int:
    """The passages block keeps its own cap exactly (numbering and order can shift a token)."""
    keep_titles = ctx.policy.extraction.keep_titles
    dropped = 0
    while (
        state.passages
        and ctx.counter.count(render_context(state.passages, keep_titles)) > ctx.policy.documents.max_tokens
    ):
        if drop_lowest_sentence(state.passages) is None:
            break
        dropped += 1
    return dropped


def render_sent(state: PipelineState, ctx: StageContext) -> RenderedPrompt:
    passages = [p for p in state.passages if not p.is_empty()]
    keep_titles = ctx.policy.extraction.keep_titles
    context_text = render_context(passages, keep_titles)
    slot_texts = render_slots(passages, keep_titles) if state.context_slots else None
    messages = render_messages(state, context_text, state.history, state.summary, ctx.policy.assembly, slot_texts)
    return RenderedPrompt(messages, ctx.counter.count_chat(messages))


def drop_least_valuable_unit(state: PipelineState, counter: CachedCounter) -> int | None:
    """Remove one unit and return its estimated tokens (None: nothing left to cut). History over its
    budget loses its oldest turn (a tool exchange goes whole), otherwise the lowest-scored passage sentence goes, then the
    summary, then the oldest turns."""
    over_history = history_tokens(counter, state) > state.history_budget
    if over_history and state.history:
        return drop_oldest_turns(state, counter)
    if over_history and state.summary:
        return drop_summary(state, counter)
    dropped = drop_lowest_sentence(state.passages)
    if dropped is not None:
        return counter.count(dropped) + 1
    if state.summary:
        return drop_summary(state, counter)
    if state.history:
        return drop_oldest_turns(state, counter)
    return None


def drop_oldest_turns(state: PipelineState, counter: CachedCounter) -> int:
    """Remove the oldest history unit (a turn, or a tool call with its replies: never half of one);
    return its estimated tokens."""
    _, end = turn_units(state.history)[0]
    dropped, state.history = state.history[:end], state.history[end:]
    return sum(turn_cost(counter, m) for m in dropped)


def drop_summary(state: PipelineState, counter: CachedCounter) -> int:
    assert state.summary is not None
    cost = counter.count(state.summary)
    state.summary = None
    return cost


# The pipeline, in order. Retrieval and the context found inside messages come first because the
# original prompt (and the cost check) must include those passages; history runs before the documents stages because the
# documents get what the system prompt, question and kept history leave.
STAGES: tuple[Stage, ...] = (
    RetrievalStage(),
    MessageContextStage(),
    CostCheckStage(),
    HistoryStage(),
    DedupStage(),
    RerankStage(),
    ExtractionStage(),
    AssemblyStage(),
    FitStage(),
)


async def run_timed(stage: Stage, state: PipelineState, ctx: StageContext) -> StageReport:
    started = time.perf_counter()
    report = await stage.run(state, ctx)
    report.ms = (time.perf_counter() - started) * 1000
    return report
