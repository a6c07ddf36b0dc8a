"""The budget is a promise: for any documents, history and budget, the sent prompt fits exactly."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxgate.compression.state import message_text
from ctxgate.compression.types import BudgetExceededError, CompressionInput, Document
from ctxgate.policies.schema import Policy

WORDS = (
    "river castle engine quantum violet harbor census treaty glacier saxophone Paris 1889 ñandú "
    "naïve café O'Brien e.g. Dr. U.S. 3.14 -- emoji 🙂 tower bridge senate vaccine orbit protein"
).split()

sentence = st.lists(st.sampled_from(WORDS), min_size=1, max_size=18).map(lambda ws: " ".join(ws) + ".")
paragraph = st.lists(sentence, min_size=1, max_size=6).map(" ".join)
documents = st.lists(
    st.builds(
        Document, text=paragraph, title=st.none() | st.sampled_from(["Alpha", "Beta site", "Gamma (film)"])
    ),
    max_size=8,
)
turn = st.builds(
    lambda role, text: {"role": role, "content": text}, st.sampled_from(["user", "assistant"]), paragraph
)


@st.composite
def policies(draw):
    max_input = draw(st.integers(16, 900))
    return Policy(
        name="prop",
        max_input_tokens=max_input,
        history={
            "max_tokens": draw(st.integers(0, 400)),
            "keep_last_turns": draw(st.integers(0, 3)),
            "strategy": draw(st.sampled_from(["summarize", "extractive", "truncate"])),
            "summary_max_tokens": draw(st.integers(8, 80)),
            "enabled": draw(st.booleans()),
        },
        documents={"max_tokens": draw(st.integers(0, max_input))},
        dedup={
            "enabled": draw(st.booleans()),
            "near_duplicate_cosine": draw(st.none() | st.floats(0.8, 0.99)),
        },
        rerank={"enabled": draw(st.booleans()), "top_k": draw(st.none() | st.integers(1, 6))},
        extraction={
            "unit": draw(st.sampled_from(["sentence", "passage"])),
            "neighbours": draw(st.integers(0, 2)),
            "keep_titles": draw(st.booleans()),
        },
        assembly={
            "order": draw(st.sampled_from(["original", "best-first", "best-at-ends"])),
            "placement": draw(st.sampled_from(["system", "user"])),
        },
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    docs=documents,
    history=st.lists(turn, max_size=6),
    system=st.none() | paragraph,
    question=paragraph,
    policy=policies(),
)
def test_sent_prompt_never_exceeds_budget(make_pipeline, tokenizer, docs, history, system, question, policy):
    pipeline = make_pipeline()
    messages = (
        ([{"role": "system", "content": system}] if system else [])
        + history
        + [{"role": "user", "content": question}]
    )
    pinned = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    request = CompressionInput(messages=messages, documents=docs, tenant="prop")
    try:
        result = asyncio.run(pipeline.run(request, policy))
    except BudgetExceededError as exc:
        # Only allowed when the pinned parts alone do not fit.
        assert tokenizer.count_chat(pinned) > policy.max_input_tokens
        assert exc.budget_tokens == policy.max_input_tokens
        return
    assert result.prompt_tokens == tokenizer.count_chat(result.messages)
    assert result.prompt_tokens <= policy.max_input_tokens
    assert result.original_prompt_tokens >= result.prompt_tokens
    # The system prompt is sent verbatim, the question text is intact and is the last user turn.
    if system:
        assert {"role": "system", "content": system} in result.messages
    last_user = [m for m in result.messages if m["role"] == "user"][-1]
    assert message_text(last_user).endswith(question)
    assert result.messages[-1]["role"] == "user"
    if result.context_text:
        assert tokenizer.count(result.context_text) <= policy.documents.max_tokens


async def test_question_too_long_raises(make_pipeline):
    pipeline = make_pipeline()
    question = "why " * 200
    policy = Policy(name="tiny", max_input_tokens=64, documents={"max_tokens": 32})
    with pytest.raises(BudgetExceededError) as info:
        await pipeline.run(CompressionInput(messages=[{"role": "user", "content": question}]), policy)
    assert info.value.required_tokens > 64
