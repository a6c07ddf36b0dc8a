"""A LangChain RAG chain through the ctxgate gateway, unchanged apart from `base_url`.

    ctxgate serve --port 8000            # or: ctxgate serve --upstreams http://vllm:8000/v1 --tokenizer DIR
    python examples/langchain_rag.py

The stuff-documents prompt puts the retrieved passages inside the system message; the gateway's
rag-default policy finds them there (documents.from_messages: a block of blank-line separated
passages of several sentences each) and cuts them to its budget. The second call sends the
documents in the `ctxgate` extension instead, built by `ctxgate.client`.
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
# Retrieved passages as a retriever returns them: several sentences each (the gateway lifts a block of
# blank-line separated passages out of a system message only when it looks like retrieved text).
DOCUMENTS = [
    Document(
        page_content=(
            "Mount Everest is Earth's highest mountain above sea level, located in the Mahalangur Himal "
            "sub-range of the Himalayas. The China-Nepal border runs across its summit point. Its elevation "
            "of 8,848.86 m was most recently established in 2020 by the Chinese and Nepali authorities. "
            "The mountain attracts many climbers, including highly experienced mountaineers."
        ),
        metadata={"title": "Mount Everest"},
    ),
    Document(
        page_content=(
            "K2, at 8,611 metres above sea level, is the second-highest mountain on Earth, after Mount Everest. "
            "It lies in the Karakoram range, partially in the Gilgit-Baltistan region of Pakistan and partially "
            "in a China-administered territory. K2 is known as the Savage Mountain because of the extreme "
            "difficulty of its ascent and one of the highest fatality rates among the eight-thousanders."
        ),
        metadata={"title": "K2"},
    ),
    Document(
        page_content=(
            "Kangchenjunga is the third-highest mountain in the world. Its summit lies at 8,586 m in a section "
            "of the Himalayas, the Kangchenjunga Himal, bounded in the west by the Tamur River and in the east "
            "by the Teesta River. It was first climbed on 25 May 1955 by Joe Brown and George Band, who were "
            "part of a British expedition. They stopped short of the summit as promised to the Chogyal."
        ),
        metadata={"title": "Kangchenjunga"},
    ),
    Document(
        page_content=(
            "The first recorded efforts to reach Everest's summit were made by British mountaineers. "
            "Tenzing Norgay and Edmund Hillary made the first official ascent of Everest in 1953, using the "
            "southeast ridge route. Norgay had reached 8,595 m the previous year as a member of the 1952 Swiss "
            "expedition. The Chinese mountaineering team of Wang Fuzhou, Gonpo and Qu Yinhua made the first "
            "reported ascent of the peak from the north ridge on 25 May 1960."
        ),
        metadata={"title": "Mount Everest"},
    ),
    Document(
        page_content=(
            "The Himalayas are a mountain range in Asia separating the plains of the Indian subcontinent from "
            "the Tibetan Plateau. The range has some of the planet's highest peaks, including the very highest, "
            "Mount Everest. More than 100 peaks exceeding 7,200 m in elevation lie in the Himalayas. The "
            "Himalayas abut or cross five countries: Bhutan, India, Nepal, China and Pakistan."
        ),
        metadata={"title": "Himalayas"},
    ),
    Document(
        page_content=(
            "Lhotse is the fourth-highest mountain in the world at 8,516 metres, after Mount Everest, K2 and "
            "Kangchenjunga. Part of the Everest massif, Lhotse is connected to Everest via the South Col. "
            "Lhotse means South Peak in Tibetan. In addition to the main summit, the mountain comprises the "
            "smaller peaks Lhotse Middle and Lhotse Shar."
        ),
        metadata={"title": "Lhotse"},
    ),
]


def retrieve(_question: str) -> str:
    # A real app calls its retriever here; create_stuff_documents_chain joins page_content by blank lines.
    return "\n\n".join(document.page_content for document in DOCUMENTS)


def main() -> None:
    llm = ChatOpenAI(
        base_url=BASE_URL,
        api_key=os.environ.get("CTXGATE_API_KEY", "unused"),
        model=MODEL,
        temperature=0,
        max_tokens=64,
    )
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{input}")])
    chain = {"context": RunnableLambda(retrieve), "input": RunnablePassthrough()} | prompt | llm

    message = chain.invoke("How tall is Mount Everest?")
    print("answer:", StrOutputParser().invoke(message))
    usage = read_usage(message)
    if usage is not None:
        print(
            f"sent {usage.prompt_tokens} of {usage.original_prompt_tokens} prompt tokens; "
            f"found in the messages: {usage.message_context}"
        )

    # The same question with the documents in the extension (policy and budget chosen per request).
    extension_llm = llm.bind(
        extra_body=ctxgate_extra_body(
            DOCUMENTS, policy="rag-default", overrides={"documents.max_tokens": 400}
        )
    )
    message = extension_llm.invoke(
        [("system", "Answer from the documents."), ("human", "How tall is Everest?")]
    )
    usage = read_usage(message)
    print("answer:", message.content, "| reduction:", round(usage.reduction, 2) if usage else None)


if __name__ == "__main__":
    main()
