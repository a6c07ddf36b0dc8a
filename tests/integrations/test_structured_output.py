"""Structured output and tool calls from real clients against a real gateway on the built-in engine:
the OpenAI SDK's `beta.chat.completions.parse`, LangChain's `with_structured_output`, and one step of
a LangChain tool-calling agent (the call, then its result sent back in the history)."""

from __future__ import annotations

import openai
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from ctxgate.eval.structured_nq import MAX_TOKENS, CitedAnswer, messages_for, questions
from tests.integrations.conftest import MODEL

NUM_QUESTIONS = 2  # the eval script runs 50 (eval/structured_nq.py)


def test_openai_sdk_parse_returns_cited_answers_on_nq(gateway_url):
    client = openai.OpenAI(base_url=gateway_url, api_key="unused", max_retries=0, timeout=300)
    for example in questions(limit=NUM_QUESTIONS):
        messages, _gold = messages_for(example)
        completion = client.beta.chat.completions.parse(
            model=MODEL,
            messages=messages,
            response_format=CitedAnswer,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ctxgate": {"policy": "passthrough"}},
        )
        assert isinstance(completion.choices[0].message.parsed, CitedAnswer), completion


def test_langchain_with_structured_output(gateway_url):
    llm = ChatOpenAI(
        model=MODEL,
        base_url=gateway_url,
        api_key="unused",
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"ctxgate": {"policy": "passthrough"}},
    )
    messages, _gold = messages_for(questions(limit=1)[0])
    answer = llm.with_structured_output(CitedAnswer, method="json_schema").invoke(messages)
    assert isinstance(answer, CitedAnswer)


@tool
def lookup(query: str) -> str:
    """Look a fact up in the town records."""
    return "The bakery opens at 7."


def test_langchain_tool_calling_agent_step(gateway_url):
    llm = ChatOpenAI(
        model=MODEL,
        base_url=gateway_url,
        api_key="unused",
        temperature=0,
        max_tokens=60,
        extra_body={"ctxgate": {"policy": "passthrough"}},
    )
    question = HumanMessage("When does the bakery open? Use the lookup tool.")
    call = llm.bind_tools([lookup], tool_choice="lookup").invoke([question])
    assert call.tool_calls and call.tool_calls[0]["name"] == "lookup"
    assert isinstance(call.tool_calls[0]["args"].get("query"), str)  # the arguments parse against the schema
    result = ToolMessage(lookup.invoke(call.tool_calls[0]["args"]), tool_call_id=call.tool_calls[0]["id"])
    final = llm.bind_tools([lookup]).invoke([question, call, result])
    assert final.content or final.tool_calls
