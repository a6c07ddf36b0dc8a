"""Per-segment accounting in the pipeline: the original and the sent prompt split into system,
history, documents and question, each side adding up exactly to its count, whatever the shape of the
request (documents in the extension, in a system message, inside the messages; history; turns after
the question)."""

from __future__ import annotations

from ctxgate.compression.counting import CachedCounter, TiktokenCounter
from ctxgate.compression.segments import Layout, balanced, segment_tokens
from ctxgate.compression.types import CompressionInput, CompressionResult
from ctxgate.policies.schema import Policy
from tests.compression.test_pipeline import DOCUMENTS, MESSAGES
from tests.town_facts import TOWN_FACTS, TOWN_QUESTION

INSTRUCTIONS = "Use the following pieces of retrieved context to answer the question."


def _sums_exactly(result: CompressionResult) -> None:
    assert sum(result.segments_original.values()) == result.original_prompt_tokens
    assert sum(result.segments_sent.values()) == result.prompt_tokens
    assert all(value >= 0 for value in [*result.segments_original.values(), *result.segments_sent.values()])


def _policy(**fields) -> Policy:
    return Policy(name="p", **{"max_input_tokens": 600, "documents": {"max_tokens": 60}, **fields})


async def test_extension_documents_in_the_user_turn(make_pipeline, tokenizer):
    result = await make_pipeline().run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), _policy())
    _sums_exactly(result)
    before, after = result.segments_original, result.segments_sent
    assert after["documents"] < before["documents"] and after["documents"] >= tokenizer.count(
        result.context_text
    )
    # Nothing but the passages was cut: the other segments are the same on both sides.
    assert {k: v for k, v in before.items() if k != "documents"} == {
        k: v for k, v in after.items() if k != "documents"
    }
    assert after["history"] == after["tools"] == 0
    # The question's segment holds the question's text (and its turn's framing), the system's the
    # system prompt's.
    assert (
        tokenizer.count(MESSAGES[1]["content"])
        < after["question"]
        < tokenizer.count(MESSAGES[1]["content"]) + 16
    )
    assert (
        tokenizer.count(MESSAGES[0]["content"])
        < after["system"]
        < tokenizer.count(MESSAGES[0]["content"]) + 12
    )


async def test_documents_in_a_system_message_of_their_own(make_pipeline):
    policy = _policy(assembly={"placement": "system"})
    result = await make_pipeline().run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), policy)
    _sums_exactly(result)
    assert result.messages[1]["content"].startswith("Documents:")
    assert result.segments_sent["documents"] > 0
    assert result.segments_sent["question"] == result.segments_original["question"]


async def test_history_is_its_own_segment_and_is_cut_to_its_budget(make_pipeline, tokenizer):
    turns = []
    for i in range(8):
        turns.append({"role": "user", "content": f"Tell me about town number {i} and its rivers, in detail."})
        turns.append({"role": "assistant", "content": f"Town {i} lies on a long river. " * 6})
    messages = [MESSAGES[0], *turns, MESSAGES[1]]
    policy = _policy(history={"max_tokens": 80, "strategy": "truncate", "keep_last_turns": 1})
    result = await make_pipeline().run(CompressionInput(messages=messages, documents=DOCUMENTS), policy)
    _sums_exactly(result)
    before, after = result.segments_original, result.segments_sent
    assert before["history"] > sum(tokenizer.count(t["content"]) for t in turns)
    assert 0 < after["history"] < before["history"]


async def test_turns_after_the_question_count_as_history(make_pipeline):
    messages = [*MESSAGES, {"role": "assistant", "content": "Let me look that up in the documents first."}]
    result = await make_pipeline().run(CompressionInput(messages=messages), _policy())
    _sums_exactly(result)
    assert result.segments_sent["history"] > 0 and result.segments_sent["documents"] == 0


async def test_documents_found_inside_a_system_message(make_pipeline, tokenizer):
    texts = [text for _, text in TOWN_FACTS[:6]]
    system = INSTRUCTIONS + "\n\n" + "\n\n".join(texts)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": TOWN_QUESTION}]
    policy = _policy(documents={"max_tokens": 60, "from_messages": True}, rerank={"top_k": 2})
    result = await make_pipeline().run(CompressionInput(messages=messages), policy)
    _sums_exactly(result)
    before, after = result.segments_original, result.segments_sent
    # The instructions stay system; the passages found after them are documents, cut.
    assert before["documents"] >= sum(tokenizer.count(text) for text in texts) - len(texts)
    assert after["documents"] < before["documents"]
    assert tokenizer.count(INSTRUCTIONS) <= after["system"] < tokenizer.count(INSTRUCTIONS) + 12
    assert after["system"] == before["system"]


async def test_a_policy_that_does_not_compress_reports_the_same_segments_on_both_sides(make_pipeline):
    policy = _policy(compression_enabled=False, max_input_tokens=2_000, documents={"max_tokens": 1_000})
    result = await make_pipeline().run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), policy)
    _sums_exactly(result)
    assert result.segments_sent == result.segments_original
    assert result.segments_sent is not result.segments_original  # the gateway adds to each side


def test_a_per_message_counter_sums_exactly_too():
    counter = CachedCounter(TiktokenCounter())
    content = "Documents:\n[1] Arlen\nArlen lies on the Vey.\n\nQuestion: Where is Arlen?"
    block = len("Documents:\n[1] Arlen\nArlen lies on the Vey.\n\n")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    layouts = [Layout("system"), Layout("question", ((0, block),))]
    total = counter.count_chat(messages)
    counts = segment_tokens(counter, messages, layouts, total)
    assert sum(counts.values()) == total
    assert counts["documents"] == counter.count(content[:block]) and counts["question"] > 0


def test_balanced_gives_the_difference_to_the_largest_and_never_goes_below_zero():
    assert balanced({"system": 5, "documents": 40, "question": 9}, 56)["documents"] == 42
    assert balanced({"system": 5, "documents": 40, "question": 9}, 52)["documents"] == 38
    shrunk = balanced({"system": 2, "documents": 3}, 1)
    assert sum(shrunk.values()) == 1 and min(shrunk.values()) >= 0
    assert balanced({}, 7) == {"system": 7, "history": 0, "documents": 0, "tools": 0, "question": 0}


def test_the_template_opening_counts_as_system_and_the_generation_prompt_as_question(tokenizer):
    counter = CachedCounter(tokenizer)
    messages = [{"role": "user", "content": "Where is Arlen?"}]
    total = counter.count_chat(messages)
    counts = segment_tokens(counter, messages, [Layout("question")], total)
    # SmolLM2's template adds its default system prompt when there is none.
    assert counts["system"] > 5 and sum(counts.values()) == total
    assert counts["question"] >= tokenizer.count("Where is Arlen?")
