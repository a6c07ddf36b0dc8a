"""Client helpers for the `ctxgate` request extension, for any OpenAI client (the OpenAI SDK, LangChain's
ChatOpenAI, LlamaIndex's OpenAILike), so applications do not hand-write its dictionaries.

    from ctxgate.client import ctxgate_extra_body, read_usage

    llm = ChatOpenAI(base_url=..., model=..., extra_body=ctxgate_extra_body(documents=docs, policy="rag-strict"))
    usage = read_usage(llm.invoke(question))   # CtxgateUsage, or None when the answer carries none
    print(usage.reduction, usage.message_context)

Dependency-free on purpose: importing it pulls in neither the gateway nor the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

DocumentLike = Any  # str | Mapping | LangChain Document | LlamaIndex Node/NodeWithScore


def ctxgate_document(document: DocumentLike) -> dict[str, Any]:
    """One `ctxgate.documents` entry from a string, a dict, a LangChain `Document` or a LlamaIndex
    node (with or without score); the title comes from a `title` field or metadata entry."""
    if isinstance(document, str):
        return {"text": document}
    if isinstance(document, Mapping):
        entry = {
            key: document[key] for key in ("text", "id", "title", "score") if document.get(key) is not None
        }
        if not isinstance(entry.get("text"), str):
            raise ValueError("a document mapping needs a string 'text'")
        return entry
    score = getattr(document, "score", None)
    node = getattr(document, "node", document)  # LlamaIndex NodeWithScore wraps the node
    text = getattr(node, "page_content", None)  # LangChain
    if text is None and hasattr(node, "get_content"):
        text = node.get_content()  # LlamaIndex: the text without metadata
    if not isinstance(text, str):
        raise ValueError(f"cannot read the text of a {type(document).__name__}")
    metadata = getattr(node, "metadata", None) or {}
    entry: dict[str, Any] = {"text": text}
    identifier = getattr(node, "id", None) or getattr(node, "node_id", None) or metadata.get("id")
    if identifier is not None:
        entry["id"] = str(identifier)
    if metadata.get("title"):
        entry["title"] = str(metadata["title"])
    if isinstance(score, int | float):
        entry["score"] = float(score)
    return entry


def ctxgate_extra_body(
    documents: Iterable[DocumentLike] | None = None,
    *,
    policy: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    retrieval_index: str | None = None,
    top_n: int = 5,
    priority: Literal["user", "background"] | None = None,
) -> dict[str, Any]:
    """The `extra_body` carrying the `ctxgate` extension: documents to budget, the policy, allowed
    overrides (dotted policy fields, e.g. {"documents.max_tokens": 400}), a stored retrieval index."""
    extension: dict[str, Any] = {}
    if documents is not None:
        extension["documents"] = [ctxgate_document(document) for document in documents]
    if policy is not None:
        extension["policy"] = policy
    if overrides:
        extension["overrides"] = dict(overrides)
    if retrieval_index is not None:
        if top_n < 1:
            raise ValueError("top_n must be at least 1")
        extension["retrieval"] = {"index": retrieval_index, "top_n": top_n}
    if priority is not None:
        extension["priority"] = priority
    return {"ctxgate": extension}


@dataclass(frozen=True)
class CtxgateUsage:
    """`usage.ctxgate` of a gateway answer: what was sent, what was cut and where, what it cost, and
    how long each part took. Every key the gateway sends is here; `to_dict()` gives them back."""

    policy: str
    original_prompt_tokens: int
    prompt_tokens: int
    tenant: str | None = None
    saved_tokens: dict[str, int] = field(default_factory=dict)
    # Per stage, and "embedding": the stages' wait for vectors (the model's first load included).
    compression_ms: dict[str, float] = field(default_factory=dict)
    compression_wait_ms: float = 0.0  # waiting for a compression worker, before the stages ran
    compression_engine_ms: float = 0.0  # of the stages' time, embedding passes on the engine's thread
    # The saved tokens at the prefill speed the gateway measured.
    estimated_prefill_ms_saved: float = 0.0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    cached_prompt_tokens: int = 0
    cost: float | None = None  # None: the policy has no prices (not "free")
    cost_detail: dict[str, Any] | None = None  # prompt, completion, total, currency
    dropped_params: list[str] = field(default_factory=list)
    # Context found inside the messages: passages/tokens found, kept and cut (None: the passages did
    # not come from the messages).
    message_context: dict[str, Any] | None = None
    # Adaptive policies: the documents budget chosen for this request, and why.
    budget: dict[str, Any] | None = None
    # Every limit the request met, after its reservation: used, remaining, when it resets (None: no limit).
    quota: list[dict[str, Any]] | None = None
    # Tokens per segment (system, history, documents, tools, question, output): {"before", "after"}.
    segments: dict[str, dict[str, int]] = field(default_factory=dict)
    # A request fitted into a limit: {"bound_by", "budget", "would_have_needed"} (None: not fitted).
    fit: dict[str, Any] | None = None

    @property
    def saved_tokens_total(self) -> int:
        return self.original_prompt_tokens - self.prompt_tokens

    @property
    def reduction(self) -> float:
        """How many times fewer prompt tokens were sent than the request had (2 decimals)."""
        return round(self.original_prompt_tokens / self.prompt_tokens, 2) if self.prompt_tokens else 0.0

    @property
    def compression_ms_total(self) -> float:
        """The stages' time and their embedding wait (not `compression_wait_ms`)."""
        return round(sum(self.compression_ms.values()), 3)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CtxgateUsage:
        cost = data.get("cost")
        return cls(
            policy=str(data.get("policy", "")),
            original_prompt_tokens=int(data.get("original_prompt_tokens", 0)),
            prompt_tokens=int(data.get("prompt_tokens", 0)),
            tenant=data.get("tenant"),
            saved_tokens=dict(data.get("saved_tokens") or {}),
            compression_ms=dict(data.get("compression_ms") or {}),
            compression_wait_ms=float(data.get("compression_wait_ms") or 0.0),
            compression_engine_ms=float(data.get("compression_engine_ms") or 0.0),
            estimated_prefill_ms_saved=float(data.get("estimated_prefill_ms_saved") or 0.0),
            queue_ms=float(data.get("queue_ms") or 0.0),
            prefill_ms=float(data.get("prefill_ms") or 0.0),
            ttft_ms=float(data.get("ttft_ms") or 0.0),
            cached_prompt_tokens=int(data.get("cached_prompt_tokens") or 0),
            cost=None if cost is None else float(cost),
            cost_detail=dict(data["cost_detail"]) if data.get("cost_detail") is not None else None,
            dropped_params=list(data.get("dropped_params") or []),
            message_context=data.get("message_context"),
            budget=data.get("budget"),
            quota=list(data["quota"]) if data.get("quota") is not None else None,
            segments={name: dict(value) for name, value in (data.get("segments") or {}).items()},
            fit=data.get("fit"),
        )

    def to_dict(self) -> dict[str, Any]:
        """`usage.ctxgate` as the gateway sends it (keys it leaves out when empty stay out)."""
        data = asdict(self) | {
            "saved_tokens_total": self.saved_tokens_total,
            "reduction": self.reduction,
            "compression_ms_total": self.compression_ms_total,
        }
        return {
            name: value
            for name, value in data.items()
            if (value is not None or name not in ("message_context", "budget", "tenant", "quota", "fit"))
            and (value or name != "segments")
        }


def read_usage(answer: Any) -> CtxgateUsage | None:
    """`usage.ctxgate` from an OpenAI SDK response or its usage, a response dict, a LangChain
    AIMessage, or a LlamaIndex ChatResponse/CompletionResponse; None when there is none."""
    block = _find_ctxgate(answer)
    return CtxgateUsage.from_dict(block) if isinstance(block, Mapping) else None


def _find_ctxgate(answer: Any) -> Any:
    if answer is None:
        return None
    if isinstance(answer, Mapping):
        if "ctxgate" in answer:
            return answer["ctxgate"]
        for key in ("usage", "token_usage"):
            if key in answer:
                return _find_ctxgate(answer[key])
        return None
    extra = getattr(answer, "model_extra", None)  # OpenAI SDK objects keep unknown fields here
    if isinstance(extra, Mapping) and "ctxgate" in extra:
        return extra["ctxgate"]
    for attribute in ("usage", "response_metadata", "raw"):  # SDK response, LangChain, LlamaIndex
        inner = getattr(answer, attribute, None)
        if inner is not None:
            found = _find_ctxgate(inner)
            if found is not None:
                return found
    return None
