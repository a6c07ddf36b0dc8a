"""`ctxgate eval message-context`: context inside the messages. NQ multi-document questions rendered
by LangChain's own stuff-documents prompt (no `ctxgate` extension field), sent through
`/v1/ctxgate/compress`.

    ctxgate eval message-context --limit 100
    ctxgate eval message-context --offset 100 --limit 100   # questions 100-199 (held out)

Checks, per the issue: prompt_tokens <= the policy budget for every request, no 413, answer retention
(a gold answer still in the sent prompt, among questions whose original prompt had one) >= 0.95, at
>= 4x fewer prompt tokens overall. Nothing is generated, so no engine runs: the gateway is started in
upstream mode (an unreachable upstream) with the local tokenizer for counting.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DATASET = "nq-multidoc-dev.jsonl"  # looked up in ../shared/data/eval when not a path
# The system prompt of LangChain's RAG tutorial (create_stuff_documents_chain + create_retrieval_chain).
SYSTEM_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
    "answer the question. If you don't know the answer, say that you don't know. Use three sentences maximum "
    "and keep the answer concise.\n\n{context}"
)


@dataclass
class Acceptance:
    requests: int
    refused: int  # 413 or any other non-200
    over_budget: int
    budget: int
    original_tokens: int
    sent_tokens: int
    reduction: float
    answerable: int  # the original prompt held a gold answer
    retained: int
    retention: float
    passages_found_mean: float
    lost: list[str]  # ids of answerable questions whose sent prompt lost every gold answer

    @property
    def passed(self) -> bool:
        return (
            self.refused == 0 and self.over_budget == 0 and self.retention >= 0.95 and self.reduction >= 4.0
        )


def langchain_messages(
    question: str, passages: list[dict[str, Any]], document_template: str = "{page_content}"
) -> list[dict[str, str]]:
    """The messages LangChain sends for this question: its stuff-documents formatting (each document
    through the document prompt, default "{page_content}", joined by blank lines) inside a
    ChatPromptTemplate, converted to OpenAI messages as ChatOpenAI does."""
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate, PromptTemplate, format_document
    from langchain_openai.chat_models.base import _convert_message_to_dict

    documents = [Document(page_content=p["text"], metadata={"title": p.get("title")}) for p in passages]
    document_prompt = PromptTemplate.from_template(document_template)
    context = "\n\n".join(format_document(document, document_prompt) for document in documents)
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM_PROMPT), ("human", "{input}")])
    return [
        _convert_message_to_dict(m)
        for m in prompt.invoke({"context": context, "input": question}).to_messages()
    ]


def measure(
    dataset: Path,
    limit: int,
    policy: str = "rag-default",
    document_template: str = "{page_content}",
    offset: int = 0,
) -> Acceptance:
    from fastapi.testclient import TestClient

    from ctxgate.backend.model.model_prepare import prepare_default_model
    from ctxgate.eval.metrics import answer_in_text
    from ctxgate.gateway.app import create_app
    from ctxgate.gateway.settings import GatewaySettings

    settings = GatewaySettings(
        upstreams=["http://127.0.0.1:9"],
        upstream_model="m",
        served_model_name="m",
        tokenizer=str(prepare_default_model()),
        default_policy=policy,
    )
    examples = [
        json.loads(line) for line in dataset.read_text().splitlines()[offset : offset + limit] if line.strip()
    ]
    refused = over = original = sent = answerable = retained = found = 0
    lost: list[str] = []
    with TestClient(create_app(settings)) as client:
        budget = next(
            p["effective"]["max_input_tokens"]
            for p in client.get("/v1/ctxgate/policies").json()["policies"]
            if p["name"] == policy
        )
        for example in examples:
            messages = langchain_messages(example["question"], example["passages"], document_template)
            response = client.post("/v1/ctxgate/compress", json={"model": "m", "messages": messages})
            if response.status_code != 200:
                refused += 1
                continue
            body = response.json()
            report = body["report"]
            over += report["prompt_tokens"] > budget
            original += report["original_prompt_tokens"]
            sent += report["prompt_tokens"]
            found += (report.get("message_context") or {}).get("passages_found", 0)
            original_text = "\n".join(m["content"] for m in messages)
            if answer_in_text(original_text, example["answers"]):
                answerable += 1
                kept = answer_in_text("\n".join(m["content"] for m in body["messages"]), example["answers"])
                retained += kept
                if not kept:
                    lost.append(example.get("id", str(len(lost))))
    done = len(examples) - refused
    return Acceptance(
        requests=len(examples),
        refused=refused,
        over_budget=over,
        budget=budget,
        original_tokens=original,
        sent_tokens=sent,
        reduction=round(original / sent, 2) if sent else 0.0,
        answerable=answerable,
        retained=retained,
        retention=round(retained / answerable, 4) if answerable else 0.0,
        passages_found_mean=round(found / done, 2) if done else 0.0,
        lost=lost,
    )
