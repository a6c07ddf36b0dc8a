"""The policy schema: one YAML file per policy, validated by these pydantic models.

The gateway owns the top-level fields, quota, cost, adaptive, fit and shadow; the compression
pipeline reads the `history`, `documents`, `dedup`, `rerank`, `extraction`, `assembly` and
`conversation` sections.
"""

from __future__ import annotations

from typing import Annotated, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ctxgate.policies.shadow import ShadowPolicy

# First-sight embedding allowance defaults (DocumentsPolicy; tuned in compression/prefilter.py).
DEFAULT_EMBED_BUDGET_MULTIPLE = 0.4
DEFAULT_EMBED_MIN_SHARE = 0.1


class _Section(BaseModel):
    # Unknown keys are typos in an operator's YAML: reject them with the field's name.
    model_config = ConfigDict(extra="forbid")


def check_time_zone(name: str) -> str:
    """`name` if it is an IANA time zone zoneinfo knows; ValueError naming it otherwise."""
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(
            f"unknown time zone '{name}' (use an IANA name such as Europe/Berlin, or UTC)"
        ) from None
    return name


# Where quota days, weeks and months begin: an IANA name, checked when the file is loaded.
TimeZone = Annotated[str, AfterValidator(check_time_zone)]


class HistoryPolicy(_Section):
    enabled: bool = Field(
        default=True, description="fit the conversation before the question into max_tokens"
    )
    max_tokens: int = Field(
        default=512, ge=0, description="budget for conversation turns before the question"
    )
    keep_last_turns: int = Field(default=2, ge=0, description="most recent turns always kept verbatim")
    strategy: Literal["summarize", "extractive", "truncate"] = Field(
        default="summarize",
        description="older turns over the budget: summarized by the model, cut to their key sentences "
        "(extractive), or dropped oldest first (truncate)",
    )
    summary_max_tokens: int = Field(default=128, ge=8, description="the summary of the older turns at most")
    summary_timeout_s: float = Field(default=10.0, gt=0, description="fall back to extractive after this")


class DocumentsPolicy(_Section):
    max_tokens: int = Field(default=1200, ge=0, description="budget for the retrieved-passages block")
    max_documents: int | None = Field(
        default=None,
        ge=1,
        description="passages kept at most after rerank; null: no limit beyond rerank.top_k",
    )
    # Find retrieved context that frameworks render inside the system/user messages (LangChain's
    # stuff-documents prompt, LlamaIndex's context chat, numbered or tagged documents, "Context:"
    # sections) and cut it like `documents`; the instructions and the question stay as they are.
    from_messages: bool = Field(
        default=False,
        description="find retrieved passages rendered inside the system or user "
        "messages and cut them like documents",
    )
    # On first sight (no cached vectors), only the sentences that match the question best lexically
    # are embedded: about this multiple of `max_tokens`, or `embed_min_share` of the input if that is
    # more (compression/prefilter.py). Lower embeds less (a cheaper first sight, less CPU taken from
    # the engine) at some answer retention (docs/decisions/prefilter-share.md).
    embed_budget_multiple: float = Field(
        default=DEFAULT_EMBED_BUDGET_MULTIPLE,
        gt=0,
        description="first-sight embedding allowance, as a multiple of max_tokens",
    )
    embed_min_share: float = Field(
        default=DEFAULT_EMBED_MIN_SHARE,
        ge=0,
        le=1,
        description="first-sight embedding allowance, at least this share of the input",
    )


class DedupPolicy(_Section):
    enabled: bool = Field(default=True, description="drop passages (and sentences) that repeat others")
    exact: bool = Field(
        default=True, description="drop exact repeats (case, accents, punctuation and spacing ignored)"
    )
    near_duplicate_cosine: float | None = Field(
        default=0.92,
        gt=0,
        le=1,
        description="drop a passage whose embedding is at least this similar to a kept one; "
        "null: exact repeats only",
    )
    sentence_level: bool = Field(default=True, description="also drop repeated sentences across passages")


class RerankPolicy(_Section):
    enabled: bool = Field(default=True, description="score passages against the question and keep the best")
    method: Literal["embedding-bm25", "embedding", "bm25", "cross-encoder", "llm"] = Field(
        default="embedding-bm25",
        description="how passages are scored: embedding similarity, BM25, both fused, a local "
        "cross-encoder, or the model itself",
    )
    top_k: int | None = Field(
        default=5, ge=1, description="passages kept, best first; null: every passage goes on to extraction"
    )
    min_score: float | None = Field(
        default=None, description="passages scoring below this are dropped; null: none"
    )
    bm25_weight: float = Field(
        default=0.3, ge=0, le=1, description="the BM25 share of the embedding-bm25 score"
    )
    cross_encoder_path: str | None = Field(
        default=None, description="a local cross-encoder model directory, for method: cross-encoder"
    )


class ExtractionPolicy(_Section):
    enabled: bool = Field(
        default=True,
        description="keep the sentences (or passages) that best answer the question, "
        "within documents.max_tokens",
    )
    unit: Literal["sentence", "passage"] = Field(
        default="sentence", description="what is kept or dropped whole"
    )
    neighbours: int = Field(
        default=0,
        ge=0,
        description="sentences either side of a chosen one added first when budget is left (coherence)",
    )
    keep_titles: bool = Field(default=True, description="render each kept passage with its title")
    # Multi-hop questions: score sentences again against the question plus the best sentence
    # found so far (pseudo-relevance feedback), so the bridge passage is found too.
    expand_query: bool = Field(
        default=False,
        description="score again against the question plus the best sentence (multi-hop questions)",
    )
    # How a sentence's relevance is computed: "fused", embedding + lexical + passage score at hand
    # weights; "learned", ctxgate.compression.learned's fitted combination of ctxgate.compression.sentence_features.
    scorer: Literal["fused", "learned"] = Field(
        default="fused",
        description="sentence relevance: hand-weighted embedding + lexical + passage score (fused), or "
        "the fitted combination (learned)",
    )


class AssemblyPolicy(_Section):
    # "stable": a canonical order by passage content, the same whatever the question, so requests that
    # share passages share a prompt prefix (and the engine's prefix cache hits).
    order: Literal["original", "best-first", "best-at-ends", "stable"] = Field(
        default="best-first",
        description="passage order in the prompt: as sent, best first, best at both ends, or "
        "by content (shared prompt prefixes)",
    )
    # Where the passages go: a system message before the conversation, or inside the last user turn.
    placement: Literal["system", "user"] = Field(
        default="user",
        description="the passages in a system message before the conversation, or in the last user turn",
    )


class ConversationPolicy(_Section):
    """Conversation memory (compression/conversation.py): how each turn was sent is remembered, so
    later turns send it again byte-identical (the engine's prefix cache keeps it) and passages
    already sent are not sent again. Off by default: a remembered turn keeps its passages in the
    history, which changes what the model sees from the second turn on and takes prompt room; an
    operator turns it on for a policy after measuring it (`ctxgate bench multiturn`)."""

    enabled: bool = Field(
        default=False,
        description="remember how each turn was sent: earlier turns go out byte-identical and "
        "passages already sent are not sent again",
    )
    ttl_s: float = Field(
        default=3600.0,
        gt=0,
        le=7 * 24 * 3600,
        description="a conversation is forgotten this many seconds after its last turn",
    )
    max_turns: int = Field(
        default=32,
        ge=1,
        le=256,
        description="user turns remembered per conversation; a longer one is compressed as without memory",
    )
    max_carried_tokens: int | None = Field(
        default=768,
        ge=0,
        description="the most tokens the carried turns may hold; over it they roll into the summary "
        "at once, all but the last history.keep_last_turns messages (null: as many as the budget "
        "leaves). Cached turns are not prefilled again, but every new token still attends to them",
    )


class ToolsPolicy(_Section):
    max_tokens: int | None = Field(
        default=None,
        ge=0,
        description="tool definitions (the tools segment) at most this many tokens; over it: 413 "
        "naming the tools segment, or shortened to fit under fit.tools: compress; null: no cap",
    )


class CostPolicy(_Section):
    prompt_per_1k: float = Field(
        default=0.0, ge=0, description="price of 1,000 prompt tokens, for usage.ctxgate.cost and spend limits"
    )
    completion_per_1k: float = Field(default=0.0, ge=0, description="price of 1,000 completion tokens")
    currency: str = Field(default="USD", description="the prices' currency, reported with the cost")


class QuotaPolicy(_Section):
    requests_per_minute: int | None = Field(
        default=None, ge=1, description="a tenant's requests per minute; null: no limit; beyond: 429"
    )
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="a tenant's prompt + completion tokens per minute; null: no limit"
    )
    tokens_per_day: int | None = Field(
        default=None, ge=1, description="a tenant's tokens per day; null: no limit"
    )
    tokens_per_week: int | None = Field(
        default=None, ge=1, description="a tenant's tokens per calendar week (from Monday); null: no limit"
    )
    tokens_per_month: int | None = Field(
        default=None, ge=1, description="a tenant's tokens per calendar month; null: no limit"
    )
    spend_per_day: float | None = Field(
        default=None,
        gt=0,
        description="a tenant's spend per day at the cost section's prices; null: no limit",
    )
    on_store_error: Literal["allow", "deny"] = Field(
        default="allow",
        description="when the quota ledger (Redis) cannot be reached: serve the request or refuse it",
    )
    window: Literal["sliding", "fixed"] = Field(
        default="sliding",
        description="the per-minute limits: sliding (no 60 seconds ever hold more than the limit) or "
        "fixed (calendar minutes: up to twice the limit across a minute's end)",
    )
    time_zone: TimeZone = Field(
        default="UTC",
        description="where the day, week and month limits begin (an IANA name such as Europe/Berlin; "
        "local midnight, DST-safe)",
    )


FitAction = Literal["reject", "compress"]


class FitPolicy(_Section):
    """What a request that does not fit a limit gets (gateway/fit.py): refused as before (`reject`), or
    compressed with the same stages into what the limit leaves (`compress`), never under the floor."""

    quota: FitAction = Field(
        default="reject",
        description="the tenant's tokens left in the window cannot hold the "
        "request at the normal budget: refuse (429) or compress the prompt into what is left",
    )
    spend: FitAction = Field(
        default="reject",
        description="the tenant's spend left (spend_per_day, budget) cannot pay for the request at the "
        "normal budget: refuse (429) or compress the prompt into the tokens what is left buys",
    )
    context_window: FitAction = Field(
        default="reject",
        description="the prompt is over the model's context window: "
        "refuse (413) or compress it to fit, even under a policy that does not compress",
    )
    max_input_tokens: FitAction = Field(
        default="reject",
        description="the prompt is over max_input_tokens: refuse "
        "(413) or compress it to fit, even under a policy that does not compress",
    )
    tools: FitAction = Field(
        default="reject",
        description="tool definitions over tools.max_tokens: refuse (413 naming the tools segment) "
        "or shorten them to fit (the parameters' descriptions dropped, then the functions')",
    )
    min_context_tokens: int = Field(
        default=256,
        ge=1,
        description="the smallest prompt budget a fitted request is "
        "given (system prompt, question and what is kept of the context); less left: "
        "the refusal, saying what would have been needed",
    )
    output: Literal["cap", "reject"] = Field(
        default="cap",
        description="quota fitting when the output reservation "
        "leaves less than min_context_tokens for the prompt: lower max_tokens to "
        "what is left (finish_reason: length), or refuse",
    )

    def action(self, limit: Literal["quota", "spend", "context_window", "max_input_tokens"]) -> FitAction:
        actions: dict[str, FitAction] = {
            "quota": self.quota,
            "spend": self.spend,
            "context_window": self.context_window,
            "max_input_tokens": self.max_input_tokens,
        }
        return actions[limit]


class AdaptivePolicy(_Section):
    """Budgets that follow the load (gateway/budget_control.py): each request's documents budget is
    the largest candidate (floor, floor + step, ..., ceiling) whose predicted TTFT keeps the SLO,
    never below the floor; when even the floor misses, admission decides, not a deeper cut."""

    enabled: bool = Field(
        default=False,
        description="choose each request's documents budget from the load (this "
        "section), instead of documents.max_tokens",
    )
    ttft_slo_s: float = Field(
        default=2.0, gt=0, le=600, description="TTFT objective (P95, seconds) the budget is chosen for"
    )
    floor_tokens: int = Field(
        default=160, ge=0, description="the tightest documents budget the controller may choose"
    )
    ceiling_tokens: int = Field(
        default=1200, ge=1, description="the loosest documents budget the controller may choose"
    )
    step_tokens: int = Field(
        default=80, ge=1, description="candidate budgets are the floor plus multiples of this"
    )
    # A prediction is a typical TTFT and the SLO a P95: aim this fraction of the SLO.
    headroom: float = Field(
        default=0.7, gt=0, le=1, description="predicted TTFT must stay under headroom x ttft_slo_s"
    )
    max_kv_usage: float = Field(
        default=0.95, gt=0, le=1, description="KV cache use above which the floor is taken"
    )
    # Damping: budgets fall at once when the load rises, but rise one step at most this often.
    relax_interval_s: float = Field(
        default=0.5, ge=0, le=60, description="least seconds between two one-step rises"
    )

    @model_validator(mode="after")
    def _range(self) -> AdaptivePolicy:
        if self.floor_tokens > self.ceiling_tokens:
            raise ValueError("adaptive.floor_tokens cannot exceed adaptive.ceiling_tokens")
        if (self.ceiling_tokens - self.floor_tokens) // self.step_tokens > 256:
            raise ValueError("adaptive: more than 256 candidate budgets; raise step_tokens")
        return self


class Policy(_Section):
    name: str = Field(
        default=...,
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="the policy's name, as requests and keys name it",
    )
    description: str = Field(default="", description="free text shown by /v1/ctxgate/policies")
    max_input_tokens: int = Field(default=2048, ge=16, description="hard cap on the prompt sent to the model")
    reserve_output_tokens: int = Field(default=256, ge=1, description="max_tokens is clamped to this")
    compression_enabled: bool = Field(
        default=True, description="false: send the prompt as it came (budgets and quotas still apply)"
    )
    # LiteLLM's convention: request fields the built-in engine cannot honour (tools, logprobs, ...)
    # are a 400 naming the field, unless this drops them (listed in usage.ctxgate.dropped_params).
    drop_params: bool = Field(
        default=False, description="drop request fields the engine cannot honour instead of a 400"
    )
    # Skip compression when the estimated prefill saving is below this many ms (0: always compress).
    min_saving_ms: float = Field(
        default=0.0,
        ge=0,
        description="skip compression when the estimated prefill saving is below this (0: always compress)",
    )
    allow_request_overrides: list[str] = Field(
        default_factory=list, description="dotted fields a request may override, e.g. documents.max_tokens"
    )
    history: HistoryPolicy = Field(
        default=HistoryPolicy(), description="the conversation before the question"
    )
    documents: DocumentsPolicy = Field(
        default=DocumentsPolicy(), description="the retrieved passages' budget"
    )
    dedup: DedupPolicy = Field(default=DedupPolicy(), description="repeated passages and sentences")
    rerank: RerankPolicy = Field(default=RerankPolicy(), description="which passages go on")
    extraction: ExtractionPolicy = Field(
        default=ExtractionPolicy(), description="which sentences of them are kept"
    )
    assembly: AssemblyPolicy = Field(
        default=AssemblyPolicy(), description="how the kept passages are put in the prompt"
    )
    conversation: ConversationPolicy = Field(
        default=ConversationPolicy(), description="memory of how a conversation's earlier turns were sent"
    )
    quota: QuotaPolicy = Field(default=QuotaPolicy(), description="the tenant's rate and spend limits")
    cost: CostPolicy = Field(
        default=CostPolicy(), description="prices, for the reported cost and spend limits"
    )
    tools: ToolsPolicy = Field(default=ToolsPolicy(), description="the tool definitions' cap")
    adaptive: AdaptivePolicy = Field(default=AdaptivePolicy(), description="budgets that follow the load")
    fit: FitPolicy = Field(
        default=FitPolicy(),
        description="compress a request into a limit it does not fit instead of refusing it",
    )
    shadow: ShadowPolicy = Field(
        default=ShadowPolicy(),
        description="answer a sample of requests again from the uncompressed prompt on idle capacity "
        "and compare",
    )

    @model_validator(mode="after")
    def _documents_fit(self) -> Policy:
        if self.documents.max_tokens > self.max_input_tokens:
            raise ValueError("documents.max_tokens cannot exceed max_input_tokens")
        if self.adaptive.enabled and self.adaptive.ceiling_tokens > self.max_input_tokens:
            raise ValueError("adaptive.ceiling_tokens cannot exceed max_input_tokens")
        return self
