"""The budget-only pipeline (used when the compression package is absent): exact, never cuts the
system prompt or the question, drops whole documents from the end, then the oldest turns."""

from __future__ import annotations

import pytest

from compression.types import BudgetExceededError, CompressionInput, Document
from gateway.pipeline import BudgetOnlyPipeline
from policies.schema import Policy

SYSTEM = {"role": "system", "content": "You answer questions about geography."}
QUESTION = {"role": "user", "content": "What river flows through Paris?"}


def _documents(count: int) -> list[Document]:
    return [Document(text=f"Passage {i}: the Seine flows through Paris and Rouen. " * 3, id=str(i))
            for i in range(count)]


def _policy(max_input: int, **extra) -> Policy:
    return Policy(name="t", max_input_tokens=max_input, documents={"max_tokens": max_input}, **extra)


async def test_documents_five_times_over_fit_exactly(tokenizer):
    pipeline = BudgetOnlyPipeline(tokenizer)
    documents = _documents(40)
    result = await pipeline.run(CompressionInput([SYSTEM, QUESTION], documents), _policy(300))
    assert result.original_prompt_tokens > 5 * 300
    assert result.prompt_tokens == tokenizer.count_chat(result.messages) <= 300
    kept = len(result.kept_documents)
    assert 0 < kept < 40 and [d.id for d in result.kept_documents] == [str(i) for i in range(kept)]
    # One more document would not have fitted: the budget is used, not wasted.
    bigger = await pipeline.run(CompressionInput([SYSTEM, QUESTION], documents[: kept + 1]), _policy(10_000))
    assert bigger.prompt_tokens > 300
    assert result.messages[0] == SYSTEM and QUESTION["content"] in result.messages[-1]["content"]
    assert sum(result.saved_tokens.values()) == result.original_prompt_tokens - result.prompt_tokens


async def test_oldest_history_goes_before_the_question(tokenizer):
    history = []
    for turn in range(6):
        history += [{"role": "user", "content": f"Tell me fact number {turn} about rivers in Europe."},
                    {"role": "assistant", "content": f"Fact {turn}: many European rivers are long. " * 3}]
    messages = [SYSTEM, *history, QUESTION]
    result = await BudgetOnlyPipeline(tokenizer).run(CompressionInput(messages), _policy(200))
    assert result.prompt_tokens <= 200
    assert result.messages[0] == SYSTEM and result.messages[-1] == QUESTION
    assert result.messages[1:-1] == history[len(history) - (len(result.messages) - 2):]
    assert result.saved_tokens["history"] > 0


async def test_question_alone_over_budget_raises(tokenizer):
    long_question = {"role": "user", "content": "why " * 200}
    with pytest.raises(BudgetExceededError) as info:
        await BudgetOnlyPipeline(tokenizer).run(CompressionInput([SYSTEM, long_question], _documents(2)),
                                                _policy(64))
    assert info.value.budget_tokens == 64 and info.value.required_tokens > 64


async def test_documents_section_budget_and_max_documents(tokenizer):
    policy = Policy(name="t", max_input_tokens=1000, documents={"max_tokens": 120, "max_documents": 3})
    result = await BudgetOnlyPipeline(tokenizer).run(CompressionInput([QUESTION], _documents(10)), policy)
    assert len(result.kept_documents) <= 3
    assert tokenizer.count(result.context_text) <= 120
