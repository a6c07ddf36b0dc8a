"""A LangChain RAG chain through the ctxgate gateway, unchanged apart from `base_url`.

    ctxgate serve --port 8000            # or: ctxgate serve --upstreams http://vllm:8000/v1 --tokenizer DIR
    python examples/langchain_rag.py

The stuff-documents prompt puts the retrieved passages inside the system message; the gateway's
rag-default policy finds them there (documents.from_messages) and cuts them to its budget. The second
call sends the documents in the `ctxgate` extension instead, built by `ctxgate.client`.
"""

from __future__ import annotations

import os

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_openai import ChatOpenAI

from ctxgate.client import ctxgate_extra_body, read_usage

BASE_URL = os.environ.get("CTXGATE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("CTXGATE_MODEL", "SmolLM2-135M-Instruct")
SYSTEM_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
    "answer the question. If you don't know the answer, say that you don't know. Use three sentences maximum "
    "and keep the answer concise.\n\n{context}"
)
DOCUMENTS = [
    Document(page_content="Mount Everest is Earth's highest mountain above sea level, in the Mahalangur Himal.",
             metadata={"title": "Mount Everest"}),
    Document(page_content="K2 is the second-highest mountain on Earth, on the China-Pakistan border.",
             metadata={"title": "K2"}),
    Document(page_content="Its elevation of 8,848.86 m was most recently established in 2020 by China and Nepal.",
             metadata={"title": "Mount Everest"}),
]


def retrieve(_question: str) -> str:
    # A real app calls its retriever here; create_stuff_documents_chain joins page_content by blank lines.
    return "\n\n".join(document.page_content for document in DOCUMENTS)


def main() -> None:
    llm = ChatOpenAI(base_url=BASE_URL, api_key=os.environ.get("CTXGATE_API_KEY", "unused"), model=MODEL,
                     temperature=0, max_tokens=64)
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{input}")])
    chain = {"context": RunnableLambda(retrieve), "input": RunnablePassthrough()} | prompt | llm

    message = chain.invoke("How tall is Mount Everest?")
    print("answer:", StrOutputParser().invoke(message))
    usage = read_usage(message)
    if usage is not None:
        print(f"sent {usage.prompt_tokens} of {usage.original_prompt_tokens} prompt tokens; "
              f"found in the messages: {usage.message_context}")

    # The same question with the documents in the extension (policy and budget chosen per request).
    extension_llm = llm.bind(extra_body=ctxgate_extra_body(DOCUMENTS, policy="rag-default",
                                                           overrides={"documents.max_tokens": 400}))
    message = extension_llm.invoke([("system", "Answer from the documents."), ("human", "How tall is Everest?")])
    usage = read_usage(message)
    print("answer:", message.content, "| reduction:", round(usage.reduction, 2) if usage else None)


if __name__ == "__main__":
    main()
