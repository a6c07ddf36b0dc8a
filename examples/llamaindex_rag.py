"""LlamaIndex through the ctxgate gateway: `OpenAILike` with `is_chat_model=True`.

    ctxgate serve --port 8000
    python examples/llamaindex_rag.py

First LlamaIndex's context chat prompt with the retrieved nodes inside the system message (found and
cut by the rag-default policy), then the nodes sent in the `ctxgate` extension via `ctxgate.client`.
"""

from __future__ import annotations

import os

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.chat_engine.context import DEFAULT_CONTEXT_TEMPLATE
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode
from llama_index.llms.openai_like import OpenAILike

from ctxgate.client import ctxgate_extra_body, read_usage

BASE_URL = os.environ.get("CTXGATE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("CTXGATE_MODEL", "SmolLM2-135M-Instruct")
NODES = [
    NodeWithScore(
        node=TextNode(
            text="Mount Everest is Earth's highest mountain above sea level.",
            metadata={"title": "Mount Everest"},
        ),
        score=0.9,
    ),
    NodeWithScore(
        node=TextNode(text="K2 is the second-highest mountain on Earth.", metadata={"title": "K2"}), score=0.5
    ),
    NodeWithScore(
        node=TextNode(
            text="Everest's elevation of 8,848.86 m was established in 2020.",
            metadata={"title": "Mount Everest"},
        ),
        score=0.8,
    ),
]


def llm(extension: dict | None = None) -> OpenAILike:
    return OpenAILike(
        model=MODEL,
        api_base=BASE_URL,
        api_key=os.environ.get("CTXGATE_API_KEY", "unused"),
        is_chat_model=True,
        context_window=2048,
        max_tokens=64,
        temperature=0,
        additional_kwargs={"extra_body": extension} if extension else {},
    )


def main() -> None:
    # What ContextChatEngine sends: its context template, filled with the retrieved nodes.
    context_str = "\n\n".join(n.node.get_content(metadata_mode=MetadataMode.LLM) for n in NODES)
    messages = [
        ChatMessage(
            role=MessageRole.SYSTEM, content=DEFAULT_CONTEXT_TEMPLATE.format(context_str=context_str)
        ),
        ChatMessage(role=MessageRole.USER, content="How tall is Mount Everest?"),
    ]
    response = llm().chat(messages)
    usage = read_usage(response)
    print("answer:", response.message.content)
    if usage is not None:
        print(f"sent {usage.prompt_tokens} of {usage.original_prompt_tokens} tokens; {usage.message_context}")

    response = llm(ctxgate_extra_body(NODES, policy="rag-default")).chat(
        [ChatMessage(role=MessageRole.USER, content="How tall is Mount Everest?")]
    )
    print("answer:", response.message.content, "| usage:", read_usage(response))


if __name__ == "__main__":
    main()
