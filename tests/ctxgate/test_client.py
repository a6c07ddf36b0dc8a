"""ctxgate.client: the extension built from each document kind, and usage read from each answer kind."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage
from llama_index.core.schema import NodeWithScore, TextNode

from ctxgate.client import CtxgateUsage, ctxgate_extra_body, read_usage

USAGE = {
    "prompt_tokens": 50,
    "completion_tokens": 2,
    "total_tokens": 52,
    "ctxgate": {
        "policy": "rag-default",
        "original_prompt_tokens": 200,
        "prompt_tokens": 50,
        "dropped_params": ["logprobs"],
        "message_context": {"passages_found": 3},
        "saved_tokens": {"rerank": 150},
        "compression_wait_ms": 12.5,
        "compression_engine_ms": 4.25,
    },
}


def test_extra_body_from_every_document_kind():
    body = ctxgate_extra_body(
        [
            "plain",
            {"text": "mapped", "title": "T", "score": None},
            Document(page_content="lc", metadata={"title": "LC"}, id="d7"),
            NodeWithScore(node=TextNode(text="li", metadata={"title": "LI"}, id_="n1"), score=0.5),
        ],
        policy="rag-strict",
        overrides={"rerank.top_k": 2},
        retrieval_index="wiki",
        top_n=3,
        priority="background",
    )
    assert body == {
        "ctxgate": {
            "documents": [
                {"text": "plain"},
                {"text": "mapped", "title": "T"},
                {"text": "lc", "id": "d7", "title": "LC"},
                {"text": "li", "id": "n1", "title": "LI", "score": 0.5},
            ],
            "policy": "rag-strict",
            "overrides": {"rerank.top_k": 2},
            "retrieval": {"index": "wiki", "top_n": 3},
            "priority": "background",
        }
    }
    assert ctxgate_extra_body() == {"ctxgate": {}}
    with pytest.raises(ValueError, match="'text'"):
        ctxgate_extra_body([{"title": "no text"}])
    with pytest.raises(ValueError, match="top_n"):
        ctxgate_extra_body(retrieval_index="wiki", top_n=0)


def test_usage_is_read_from_dicts_and_langchain_messages():
    from_dict = read_usage({"id": "x", "usage": USAGE})
    assert isinstance(from_dict, CtxgateUsage)
    assert (from_dict.reduction, from_dict.dropped_params, from_dict.message_context) == (
        4.0,
        ["logprobs"],
        {"passages_found": 3},
    )
    assert from_dict.compression_wait_ms == 12.5 and from_dict.compression_engine_ms == 4.25
    older = CtxgateUsage.from_dict({"policy": "p"})  # an older gateway's usage
    assert (older.compression_wait_ms, older.cost, older.estimated_prefill_ms_saved) == (0.0, None, 0.0)
    message = AIMessage(content="hi", response_metadata={"token_usage": USAGE})
    assert read_usage(message) == from_dict
    assert read_usage({"usage": {"prompt_tokens": 1}}) is None
    assert read_usage(AIMessage(content="no usage")) is None


def test_every_key_of_a_gateways_usage_round_trips():
    sent = {
        "tenant": "acme",
        "policy": "rag-default",
        "original_prompt_tokens": 900,
        "prompt_tokens": 300,
        "saved_tokens_total": 600,
        "reduction": 3.0,
        "estimated_prefill_ms_saved": 120.5,
        "compression_ms_total": 19.5,
        "saved_tokens": {"cost-check": 0, "rerank": 450, "fit": 150},
        "compression_ms": {"cost-check": 1.5, "rerank": 3.0, "fit": 1.0, "embedding": 14.0},
        "compression_wait_ms": 0.25,
        "compression_engine_ms": 0.0,
        "queue_ms": 1.5,
        "prefill_ms": 80.25,
        "ttft_ms": 95.0,
        "cached_prompt_tokens": 16,
        "cost": None,
        "cost_detail": None,
        "dropped_params": ["seed"],
        "message_context": {"passages_found": 6, "passages_kept": 2},
        "budget": {"documents_tokens": 400},
        "segments": {
            "system": {"before": 20, "after": 20},
            "documents": {"before": 860, "after": 260},
            "question": {"before": 20, "after": 20},
            "output": {"before": 12, "after": 12},
        },
        "fit": {"bound_by": "quota", "budget": 300, "would_have_needed": 1200},
    }
    usage = CtxgateUsage.from_dict(sent)
    assert usage.to_dict() == sent
    assert (usage.saved_tokens_total, usage.reduction, usage.compression_ms_total) == (600, 3.0, 19.5)
    priced = CtxgateUsage.from_dict(
        sent | {"cost": 0.0012, "cost_detail": {"total": 0.0012, "currency": "USD"}}
    )
    assert (priced.cost, priced.cost_detail["currency"]) == (0.0012, "USD")
    lean = {
        key: value
        for key, value in sent.items()
        if key not in ("message_context", "budget", "segments", "fit")
    }
    assert CtxgateUsage.from_dict(lean).to_dict() == lean  # keys the gateway leaves out stay out
