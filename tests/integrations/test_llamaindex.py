"""LlamaIndex (OpenAILike, is_chat_model=True) against a real gateway: its context chat prompt with
the nodes inside the system message, its text-QA prompt inside the user message, and the nodes in
`extra_body`."""

from __future__ import annotations

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.chat_engine.context import DEFAULT_CONTEXT_TEMPLATE
from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode
from llama_index.llms.openai_like import OpenAILike

from ctxgate.client import ctxgate_extra_body, read_usage
from tests.integrations.conftest import FACTS, MODEL, OVERRIDES, QUESTION

NODES = [
    NodeWithScore(node=TextNode(text=text, metadata={"title": f"Town {name}"}), score=1.0)
    for name, text in FACTS
]


def _llm(gateway_url: str, extension: dict) -> OpenAILike:
    return OpenAILike(
        model=MODEL,
        api_base=gateway_url,
        api_key="unused",
        is_chat_model=True,
        max_tokens=4,
        temperature=0,
        context_window=2048,
        max_retries=0,
        additional_kwargs={"extra_body": extension},
    )


def _context_str() -> str:
    # How LlamaIndex's context chat engine renders retrieved nodes (metadata lines, then the text).
    return "\n\n".join(n.node.get_content(metadata_mode=MetadataMode.LLM) for n in NODES)


def test_context_chat_prompt_in_system_message(gateway_url):
    llm = _llm(gateway_url, ctxgate_extra_body(overrides=OVERRIDES))
    system = DEFAULT_CONTEXT_TEMPLATE.format(context_str=_context_str())
    response = llm.chat(
        [
            ChatMessage(role=MessageRole.SYSTEM, content=system),
            ChatMessage(role=MessageRole.USER, content=QUESTION),
        ]
    )
    assert response.message.content
    usage = read_usage(response)
    found = usage.message_context
    assert (found["message"], found["layout"], found["passages_found"]) == ("system[0]", "dashed", len(FACTS))
    assert found["tokens_cut"] > 0 and usage.prompt_tokens < usage.original_prompt_tokens


def test_text_qa_prompt_in_user_message(gateway_url):
    llm = _llm(gateway_url, ctxgate_extra_body(overrides=OVERRIDES))
    user = DEFAULT_TEXT_QA_PROMPT.format(context_str=_context_str(), query_str=QUESTION)
    response = llm.chat([ChatMessage(role=MessageRole.USER, content=user)])
    found = read_usage(response).message_context
    assert (found["message"], found["passages_found"]) == ("question", len(FACTS))
    assert found["passages_kept"] < len(FACTS)


def test_nodes_in_extra_body(gateway_url):
    llm = _llm(gateway_url, ctxgate_extra_body(NODES, overrides=OVERRIDES))
    response = llm.chat([ChatMessage(role=MessageRole.USER, content=QUESTION)])
    usage = read_usage(response)
    assert usage.reduction > 1.5 and usage.message_context is None
