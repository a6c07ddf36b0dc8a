"""ctxgate.client: the extension built from each document kind, and usage read from each answer kind."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage
from llama_index.core.schema import NodeWithScore, TextNode

from ctxgate.client import CtxgateUsage, ctxgate_extra_body, read_usage

USAGE = {"prompt_tokens": 50, "completion_tokens": 2, "total_tokens": 52, "ctxgate": {
    "policy": "rag-default", "original_prompt_tokens": 200, "prompt_tokens": 50, "dropped_params": ["logprobs"],
    "message_context": {"passages_found": 3}, "saved_tokens": {"rerank": 150}, "compression_wait_ms": 12.5,
    "compression_engine_ms": 4.25}}


def test_extra_body_from_every_document_kind():
    body = ctxgate_extra_body(
        ["plain", {"text": "mapped", "title": "T", "score": None},
         Document(page_content="lc", metadata={"title": "LC"}, id="d7"),
         NodeWithScore(node=TextNode(text="li", metadata={"title": "LI"}, id_="n1"), score=0.5)],
        policy="rag-strict", overrides={"rerank.top_k": 2}, retrieval_index="wiki", top_n=3, priority="background")
    assert body == {"ctxgate": {
        "documents": [{"text": "plain"}, {"text": "mapped", "title": "T"},
                      {"text": "lc", "id": "d7", "title": "LC"},
                      {"text": "li", "id": "n1", "title": "LI", "score": 0.5}],
        "policy": "rag-strict", "overrides": {"rerank.top_k": 2}, "retrieval": {"index": "wiki", "top_n": 3},
        "priority": "background"}}
    assert ctxgate_extra_body() == {"ctxgate": {}}
    with pytest.raises(ValueError, match="'text'"):
        ctxgate_extra_body([{"title": "no text"}])
    with pytest.raises(ValueError, match="top_n"):
        ctxgate_extra_body(retrieval_index="wiki", top_n=0)


def test_usage_is_read_from_dicts_and_langchain_messages():
    from_dict = read_usage({"id": "x", "usage": USAGE})
    assert isinstance(from_dict, CtxgateUsage)
    assert (from_dict.reduction, from_dict.dropped_params, from_dict.message_context) == (
        4.0, ["logprobs"], {"passages_found": 3})
    assert from_dict.compression_wait_ms == 12.5 and from_dict.compression_engine_ms == 4.25
    assert CtxgateUsage.from_dict({"policy": "p"}).compression_wait_ms == 0.0  # an older gateway's usage
    message = AIMessage(content="hi", response_metadata={"token_usage": USAGE})
    assert read_usage(message) == from_dict
    assert read_usage({"usage": {"prompt_tokens": 1}}) is None
    assert read_usage(AIMessage(content="no usage")) is None
