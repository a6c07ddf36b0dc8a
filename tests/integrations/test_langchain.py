"""LangChain (langchain-openai ChatOpenAI) against a real gateway: a stuff-documents RAG chain with the
passages inside the prompt, and the same question with the documents in `extra_body`."""

from __future__ import annotations

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate, format_document
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_openai import ChatOpenAI

from ctxgate.client import ctxgate_extra_body, read_usage
from tests.integrations.conftest import FACTS, MODEL, OVERRIDES, QUESTION

# LangChain's RAG tutorial prompt (create_stuff_documents_chain + create_retrieval_chain).
SYSTEM_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
    "answer the question. If you don't know the answer, say that you don't know. Use three sentences maximum "
    "and keep the answer concise.\n\n{context}"
)
DOCUMENTS = [Document(page_content=text, metadata={"title": f"Town {name}"}) for name, text in FACTS]


def _stuff(documents: list[Document]) -> str:
    # What create_stuff_documents_chain does: each document through "{page_content}", joined by blank lines.
    return "\n\n".join(format_document(d, PromptTemplate.from_template("{page_content}")) for d in documents)


def _llm(gateway_url: str, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=gateway_url,
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=4,
        max_retries=0,
        **kwargs,
    )


def test_stuff_documents_chain_context_is_found_and_cut(gateway_url):
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{input}")])
    # The extension only tightens the budget here; the passages themselves are inside the prompt.
    llm = _llm(gateway_url, extra_body=ctxgate_extra_body(overrides=OVERRIDES))
    chain = (
        {"context": RunnableLambda(lambda _: _stuff(DOCUMENTS)), "input": RunnablePassthrough()}
        | prompt
        | llm
    )
    message = chain.invoke(QUESTION)
    assert message.content
    usage = read_usage(message)
    assert usage is not None and usage.policy == "rag-default"
    found = usage.message_context
    assert (found["message"], found["passages_found"]) == ("system[0]", len(FACTS))
    assert found["passages_kept"] < len(FACTS) and found["tokens_cut"] > 0
    assert usage.prompt_tokens < usage.original_prompt_tokens

    text = (chain | StrOutputParser()).invoke(QUESTION)  # the plain LCEL chain works end to end
    assert isinstance(text, str) and text


def test_documents_in_extra_body(gateway_url):
    llm = _llm(gateway_url, extra_body=ctxgate_extra_body(DOCUMENTS, overrides=OVERRIDES))
    message = llm.invoke([("system", "Answer from the documents."), ("human", QUESTION)])
    usage = read_usage(message)
    assert usage is not None and usage.message_context is None  # the passages did not come from the messages
    assert usage.reduction > 1.5
    assert usage.saved_tokens["rerank"] > 0
