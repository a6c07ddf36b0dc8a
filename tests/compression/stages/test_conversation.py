"""Conversation memory through the real pipeline: earlier turns go out byte-identical (in-process
memory and real Redis, two pipelines sharing it), a passage already sent is not sent again, the
summary rolls forward append-only, and one tenant never sees another's conversation."""

from __future__ import annotations

import pytest

from ctxgate.compression.conversation import ConversationMemory, ConversationRecord, SentTurn
from ctxgate.compression.store.cache import LRUBytesCache
from ctxgate.compression.types import CompressionInput, CompressionResult, Document
from ctxgate.policies.schema import Policy

SYSTEM = {"role": "system", "content": "Answer from the documents."}
TOWNS = {
    name: Document(
        text=f"{name} lies on the river {river}. Its mayor is {mayor}. It has {people} people.",
        title=f"Town {name}",
    )
    for name, river, mayor, people in [
        ("Arlen", "Vey", "Ida Holm", 1200),
        ("Brisk", "Orn", "Tomas Veld", 5400),
        ("Cirra", "Lune", "Mara Quist", 870),
        ("Dovel", "Sarn", "Pell Ochs", 23000),
        ("Esker", "Tay", "Una Brack", 310),
        ("Fallow", "Wend", "Rolf Jansk", 4100),
    ]
}
# Follow-up questions over the same and new passages, as a RAG chat retrieves them turn by turn.
TURNS = [
    ("Who is the mayor of Arlen?", ["Arlen", "Brisk"]),
    ("And which river runs through Brisk?", ["Brisk", "Cirra"]),
    ("How many people live in Cirra?", ["Cirra", "Arlen", "Dovel"]),
    ("Who is the mayor of Dovel?", ["Dovel", "Esker"]),
    ("Which river runs through Esker?", ["Esker", "Fallow", "Arlen"]),
]


def policy(enabled: bool = True, max_input_tokens: int = 2000, **history) -> Policy:
    return Policy(
        name="conv",
        max_input_tokens=max_input_tokens,
        documents={"max_tokens": 200},
        history={"strategy": "extractive", **history},
        conversation={"enabled": enabled},
    )


async def converse(
    pipelines, rules: Policy, tenant: str = "acme", conversation: str | None = "chat-1", turns=TURNS
) -> list[CompressionResult]:
    """The turns of one conversation, sent to the pipelines in turn (replicas), each answer appended."""
    messages = [SYSTEM]
    results = []
    for index, (question, towns) in enumerate(turns):
        messages.append({"role": "user", "content": question})
        request = CompressionInput(
            messages=list(messages),
            documents=[TOWNS[name] for name in towns],
            tenant=tenant,
            conversation=conversation,
        )
        results.append(await pipelines[index % len(pipelines)].run(request, rules))
        messages.append({"role": "assistant", "content": f"Answer {index}."})
    return results


def stage(result: CompressionResult, name: str) -> dict:
    return next(report.details for report in result.stages if report.name == name)


def assert_each_prompt_extends_the_last(results: list[CompressionResult]) -> None:
    for before, after in zip(results, results[1:], strict=False):
        assert after.messages[: len(before.messages)] == before.messages


async def test_earlier_turns_are_sent_byte_identical(make_pipeline):
    results = await converse([make_pipeline()], policy())
    assert_each_prompt_extends_the_last(results)
    assert [stage(r, "conversation")["matched_turns"] for r in results] == [0, 1, 3, 5, 7]
    for result in results:
        assert result.prompt_tokens <= 2000
    # Without memory the first turn's passages are gone from the second prompt: no shared prefix
    # beyond the system prompt and the first question's text.
    today = await converse([make_pipeline()], policy(enabled=False))
    assert today[1].messages[: len(today[0].messages)] != today[0].messages
    assert all(report.name != "conversation" for report in today[1].stages)


async def test_two_pipelines_sharing_redis_send_the_same_prefixes(make_pipeline, redis_server):
    from ctxgate.compression.store.redis_cache import RedisBytesCache

    redis_server.start()
    replicas = [make_pipeline(cache=RedisBytesCache(redis_server.url)) for _ in range(2)]
    alternating = await converse(replicas, policy())
    assert_each_prompt_extends_the_last(alternating)
    one_process = await converse([make_pipeline()], policy())
    assert [r.messages for r in alternating] == [r.messages for r in one_process]


async def test_a_passage_already_sent_is_not_sent_again(make_pipeline):
    results = await converse([make_pipeline()], policy())
    second = results[1]
    brisk = TOWNS["Brisk"].text
    sent_before, new_turn = second.messages[1:-1], second.messages[-1]["content"]
    assert any(brisk in m["content"] for m in sent_before)  # turn 1's block, carried
    assert brisk not in new_turn and "Town Brisk" not in new_turn
    assert TOWNS["Cirra"].text in new_turn  # the budget went to the new passage
    assert stage(second, "conversation")["sent_passages_dropped"] == 1
    assert all(d.title != "Town Brisk" for d in second.kept_documents)


async def test_the_summary_rolls_forward_append_only(make_pipeline):
    # Room for about two carried turns: the oldest roll into the summary, two messages at a time.
    rules = policy(max_input_tokens=420, max_tokens=150, summary_max_tokens=96)
    results = await converse([make_pipeline()], rules)
    summaries = [
        next((m["content"] for m in r.messages if m["content"].startswith("Summary")), "") for r in results
    ]
    assert summaries[-1], "the conversation outgrew its room: a summary was rolled"
    for before, after in zip(results, results[1:], strict=False):
        assert after.prompt_tokens <= 420
        shared = after.messages[: len(before.messages)] == before.messages
        summary_before = next(
            (m["content"] for m in before.messages if m["content"].startswith("Summary")), ""
        )
        summary_after = next((m["content"] for m in after.messages if m["content"].startswith("Summary")), "")
        # Either the whole earlier prompt is a prefix, or a roll step appended to the summary.
        assert shared or summary_after.startswith(summary_before)
    steps = sum(
        a.messages[: len(b.messages)] != b.messages for b, a in zip(results, results[1:], strict=False)
    )
    assert 1 <= steps < len(results) - 1


async def test_carried_turns_roll_at_once_past_max_carried_tokens(make_pipeline):
    """Past `max_carried_tokens` (however large the budget) every carried turn but the last
    `keep_last_turns` messages leaves into the summary, and the kept ones go out as the client wrote
    them, without their passages; the turn after the roll extends the rolled prompt again."""
    rules = Policy(
        name="conv",
        max_input_tokens=2000,
        documents={"max_tokens": 200},
        history={"strategy": "extractive", "keep_last_turns": 2, "max_tokens": 100},
        conversation={"enabled": True, "max_carried_tokens": 160},
    )
    results = await converse([make_pipeline()], rules)
    rolls = [i for i, result in enumerate(results) if stage(result, "conversation")["carried_from"] > 0]
    assert rolls, "the carried turns outgrew max_carried_tokens"
    first = results[rolls[0]]
    history = first.messages[1:-1]
    assert history[0]["content"].startswith("Summary")
    kept = history[1:]
    assert len(kept) == 2 and [m["role"] for m in kept] == ["user", "assistant"]
    assert kept[0]["content"] == TURNS[rolls[0] - 1][0]  # the question as asked, no passages block
    assert all("Documents" not in m["content"] for m in kept)
    if rolls[0] + 1 < len(results) and rolls[0] + 1 not in rolls:
        assert_each_prompt_extends_the_last(results[rolls[0] : rolls[0] + 2])


async def test_one_tenant_never_reads_another_tenants_conversation(make_pipeline):
    pipeline = make_pipeline()
    await converse([pipeline], policy(), tenant="acme", turns=TURNS[:1])
    # Another tenant, the same conversation key and question, other passages: it carries its own.
    other_turns = [(TURNS[0][0], ["Fallow"]), TURNS[1]]
    other = await converse([pipeline], policy(), tenant="evil", turns=other_turns)
    carried = " ".join(m["content"] for m in other[1].messages[1:-1])
    assert TOWNS["Fallow"].text in carried and TOWNS["Arlen"].text not in carried
    # ...and cannot poison acme's memory: acme's second turn carries acme's first block.
    second = CompressionInput(
        messages=[
            SYSTEM,
            {"role": "user", "content": TURNS[0][0]},
            {"role": "assistant", "content": "Answer 0."},
            {"role": "user", "content": TURNS[1][0]},
        ],
        documents=[TOWNS["Brisk"], TOWNS["Cirra"]],
        tenant="acme",
        conversation="chat-1",
    )
    acme = await pipeline.run(second, policy())
    carried = " ".join(m["content"] for m in acme.messages[1:-1])
    assert TOWNS["Arlen"].text in carried and TOWNS["Fallow"].text not in carried
    assert stage(acme, "conversation")["matched_turns"] == 1


async def test_another_conversation_key_starts_afresh(make_pipeline):
    pipeline = make_pipeline()
    await converse([pipeline], policy(), conversation="chat-1", turns=TURNS[:1])
    messages = [
        SYSTEM,
        {"role": "user", "content": TURNS[0][0]},
        {"role": "assistant", "content": "Answer 0."},
    ]
    request = CompressionInput(
        messages=[*messages, {"role": "user", "content": TURNS[1][0]}],
        documents=[TOWNS["Brisk"]],
        tenant="acme",
        conversation="chat-2",
    )
    result = await pipeline.run(request, policy())
    assert stage(result, "conversation")["matched_turns"] == 0
    assert result.messages[1] == messages[1]  # the first question as the client wrote it


def test_memory_forgets_after_ttl_and_ignores_damaged_entries():
    now = [1000.0]
    cache = LRUBytesCache(max_bytes=1 << 20)
    memory = ConversationMemory(cache, clock=lambda: now[0])
    memory.save("acme", "chat", ConversationRecord([SentTurn("d", "ctx", ["s"])]), ttl_s=60)
    assert memory.load("acme", "chat").turns[0].context == "ctx"
    assert memory.load("other", "chat") is None
    now[0] += 61
    assert memory.load("acme", "chat") is None
    for damaged in (
        b"not json",
        b'{"v": 1}',
        b'{"v": 1, "turns": 5, "start": 0, "summary": null, "expires_at": 1e12}',
    ):
        assert ConversationRecord.from_bytes(damaged) is None


@pytest.mark.parametrize("placement", ["system"])
async def test_passages_outside_the_question_turn_are_not_carried(make_pipeline, placement):
    rules = policy().model_copy(
        update={"assembly": policy().assembly.model_copy(update={"placement": placement})}
    )
    results = await converse([make_pipeline()], rules, turns=TURNS[:2])
    assert all(report.name != "conversation" for result in results for report in result.stages)


async def test_an_edited_turn_is_carried_up_to_the_edit(make_pipeline):
    pipeline = make_pipeline()
    results = await converse([pipeline], policy(), turns=TURNS[:2])
    # The client edits its second question and asks a third: the first turn is still carried as
    # sent, the edited one is sent as written.
    edited = {"role": "user", "content": "Which river runs through Cirra, really?"}
    request = CompressionInput(
        messages=[
            SYSTEM,
            {"role": "user", "content": TURNS[0][0]},
            {"role": "assistant", "content": "Answer 0."},
            edited,
            {"role": "assistant", "content": "Answer 1."},
            {"role": "user", "content": TURNS[2][0]},
        ],
        documents=[TOWNS["Dovel"]],
        tenant="acme",
        conversation="chat-1",
    )
    third = await pipeline.run(request, policy())
    assert stage(third, "conversation")["matched_turns"] == 2
    assert third.messages[:3] == results[1].messages[:3]
    assert third.messages[3] == edited


async def test_a_conversation_over_max_turns_is_compressed_without_memory(make_pipeline):
    rules = policy().model_copy(
        update={"conversation": policy().conversation.model_copy(update={"max_turns": 2})}
    )
    results = await converse([make_pipeline()], rules, turns=TURNS[:3])
    assert stage(results[2], "conversation") == {"skipped": "over max_turns 2"}
    assert TOWNS["Arlen"].text not in results[2].messages[1]["content"]  # the first turn as written
