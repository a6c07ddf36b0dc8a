"""History summarization through the real in-process engine: cache, rolling updates, fallbacks."""

from __future__ import annotations

import asyncio

import pytest

from ctxgate.compression.types import CompressionInput
from ctxgate.policies.schema import Policy

CONVERSATION = [
    {"role": "user", "content": "Hi, I am planning a trip to Lisbon in May with my sister Ana."},
    {"role": "assistant", "content": "Lisbon in May is lovely. Do you have a budget in mind?"},
    {"role": "user", "content": "About 1200 euros each, and we love seafood and old trams."},
    {"role": "assistant", "content": "Then take tram 28 through Alfama and eat at Cervejaria Ramiro."},
    {"role": "user", "content": "Great. Ana is vegetarian though, so she skips the seafood."},
    {
        "role": "assistant",
        "content": "Noted: pick places with vegetarian menus, like Ao 26 Vegan Food Project.",
    },
]
QUESTION = {"role": "user", "content": "Which tram did you recommend?"}


class CountingEngine:
    """Delegates to the real engine and counts generate() calls at the EngineClient boundary."""

    def __init__(self, engine):
        self._engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.generate_calls = 0
        self.salts: list[str | None] = []  # each call's cache salt: whose summary it was

    def generate(self, request):
        self.generate_calls += 1
        self.salts.append(request.cache_salt)
        return self._engine.generate(request)

    async def abort(self, request_id):
        await self._engine.abort(request_id)

    def is_ready(self):
        return self._engine.is_ready()


@pytest.fixture(scope="module")
def engine(model_dir):
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig

    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        num_kv_blocks=96,
        max_num_batched_tokens=256,
        max_num_seqs=2,
        max_model_len=768,
    )
    async_engine = AsyncEngine(config)
    yield async_engine
    async_engine.shutdown()


def summary_policy(timeout_s: float = 60.0, strategy: str = "summarize") -> Policy:
    return Policy(
        name="history",
        max_input_tokens=1024,
        documents={"max_tokens": 512},
        history={
            "max_tokens": 90,
            "keep_last_turns": 2,
            "strategy": strategy,
            "summary_max_tokens": 24,
            "summary_timeout_s": timeout_s,
        },
    )


def history_report(result):
    return next(stage for stage in result.stages if stage.name == "history")


async def test_summary_is_cached_and_rolled_forward(make_pipeline, engine, tokenizer):
    counting = CountingEngine(engine)
    pipeline = make_pipeline(engine=counting)
    request = CompressionInput(messages=CONVERSATION + [QUESTION], tenant="alice")

    first = await pipeline.run(request, summary_policy())
    report = history_report(first)
    assert report.details["summary_source"] == "engine"
    assert counting.generate_calls == 1
    assert report.saved_tokens > 0
    assert first.prompt_tokens == tokenizer.count_chat(first.messages) <= 1024
    assert first.messages[-3:] == CONVERSATION[-2:] + [QUESTION]  # last turns verbatim
    summary_message = next(m for m in first.messages if m["content"].startswith("Summary of the earlier"))
    assert len(summary_message["content"]) > 40
    # Client-derived text: a quoted user turn where the summarized turns were, never a system message.
    assert summary_message["role"] == "user"
    assert summary_message["content"].startswith("Summary of the earlier conversation:\n> ")
    assert "\n" not in summary_message["content"].split("\n", 1)[1]
    assert first.messages.index(summary_message) == len(first.messages) - 4  # right before the kept turns
    assert not any(m["role"] == "system" for m in first.messages)

    second = await pipeline.run(request, summary_policy())
    assert history_report(second).details["summary_source"] == "cache"
    assert counting.generate_calls == 1  # same history: no second engine call
    assert second.messages == first.messages

    # The conversation goes on: only the newly old turns are summarized, on top of the cached summary.
    longer = CONVERSATION + [
        {"role": "user", "content": "Also, what about day trips?"},
        {"role": "assistant", "content": "Sintra is 40 minutes by train and has the Pena Palace."},
    ]
    third = await pipeline.run(
        CompressionInput(messages=longer + [QUESTION], tenant="alice"), summary_policy()
    )
    assert history_report(third).details["engine_calls"] == 1
    assert counting.generate_calls == 2

    # Summaries are per tenant: another tenant's identical history is summarized anew.
    await pipeline.run(CompressionInput(messages=CONVERSATION + [QUESTION], tenant="bob"), summary_policy())
    assert counting.generate_calls == 3


async def test_timeout_falls_back_to_extractive(make_pipeline, engine, tokenizer):
    counting = CountingEngine(engine)
    pipeline = make_pipeline(engine=counting)
    request = CompressionInput(messages=CONVERSATION + [QUESTION], tenant="carol")
    result = await pipeline.run(request, summary_policy(timeout_s=0.001))
    report = history_report(result)
    assert counting.generate_calls == 1  # it tried the engine
    assert report.details["summary_source"] == "extractive"
    summary_turn = next(m for m in result.messages if m["content"].startswith("Summary of the earlier"))
    summary = summary_turn["content"]
    assert "tram" in summary.lower()  # the sentence related to the question was kept
    # The extractive summary is verbatim user text: quoted, in a user turn, never a system message.
    assert summary_turn["role"] == "user" and summary.startswith("Summary of the earlier conversation:\n> ")
    assert not any(m["role"] == "system" for m in result.messages)
    assert result.prompt_tokens == tokenizer.count_chat(result.messages) <= 1024


async def test_no_engine_or_saturated_engine_is_extractive(make_pipeline, engine):
    request = CompressionInput(messages=CONVERSATION + [QUESTION], tenant="dave")
    without_engine = await make_pipeline(engine=None).run(request, summary_policy())
    assert history_report(without_engine).details["summary_source"] == "extractive"

    class NotReady(CountingEngine):
        def is_ready(self):
            return False

    saturated = NotReady(engine)
    result = await make_pipeline(engine=saturated).run(request, summary_policy())
    assert history_report(result).details["summary_source"] == "extractive"
    assert saturated.generate_calls == 0


async def test_truncate_strategy_drops_oldest_turns(make_pipeline):
    result = await make_pipeline().run(
        CompressionInput(messages=CONVERSATION + [QUESTION]), summary_policy(strategy="truncate")
    )
    assert result.messages[-1] == QUESTION
    assert CONVERSATION[0] not in result.messages
    assert CONVERSATION[-1] in result.messages
    assert not any(m["content"].startswith("Summary of") for m in result.messages)


async def test_a_compression_worker_summarizes_through_the_engine_on_the_callers_loop(make_pipeline, engine):
    """With workers the pipeline reaches the engine through `LoopBridge` (the declared SummaryEngine
    surface, nothing else): the engine's calls run on the caller's event loop, the summary comes back."""
    from ctxgate.compression.pipeline import LoopBridge

    counting = CountingEngine(engine)
    pipeline = make_pipeline(engine=counting, workers=1)
    try:
        result = await pipeline.run(
            CompressionInput(messages=CONVERSATION + [QUESTION], tenant="erin"), summary_policy()
        )
        assert isinstance(pipeline.engine, LoopBridge)
        assert pipeline.engine.max_model_len == engine.max_model_len and pipeline.engine.is_ready()
    finally:
        pipeline.close()
    assert history_report(result).details["summary_source"] == "engine"
    assert counting.generate_calls == 1


async def test_a_tenant_has_one_engine_summary_in_flight(make_pipeline, engine):
    """Requests with fresh histories sent at once: one of the tenant's summaries goes to the engine,
    the rest get the extractive summary without waiting for it; another tenant still gets its own
    engine call, and the slot is given back when the summary ends (however it ends)."""
    from ctxgate.compression.history import HistorySummarizer

    counting = CountingEngine(engine)
    pipeline = make_pipeline(engine=counting)
    policy = summary_policy(timeout_s=5.0)

    def fresh(tenant: str, n: int) -> CompressionInput:
        opening = {"role": "user", "content": f"Trip number {n}: we land in Lisbon on a Tuesday."}
        return CompressionInput(messages=[opening, *CONVERSATION, QUESTION], tenant=tenant)

    def calls_of(tenant: str) -> int:
        return counting.salts.count(HistorySummarizer.salt(tenant))

    flood = [pipeline.run(fresh("mallory", n), policy) for n in range(4)]
    results = await asyncio.gather(*flood, pipeline.run(fresh("alice", 0), policy))
    sources = [history_report(result).details["summary_source"] for result in results]
    assert calls_of("mallory") == 1 and calls_of("alice") == 1
    assert sources[:4].count("extractive") >= 3
    await pipeline.run(fresh("mallory", 9), policy)
    assert calls_of("mallory") == 2


async def test_a_conversation_roll_never_generates(make_pipeline, engine):
    """Conversation memory's roll appends an extractive summary: a roll already makes the engine
    prefill the turns after it again, and an engine summary would add a generation to that turn."""
    counting = CountingEngine(engine)
    pipeline = make_pipeline(engine=counting)
    policy = Policy(
        name="conversation-roll",
        max_input_tokens=1024,
        documents={"max_tokens": 256},
        history={"max_tokens": 48, "keep_last_turns": 2, "strategy": "summarize", "summary_max_tokens": 48},
        conversation={"enabled": True, "max_carried_tokens": 48},
    )
    messages: list[dict] = []
    rolled = 0
    for turn in (*CONVERSATION[::2], QUESTION):
        messages.append(turn)
        request = CompressionInput(messages=list(messages), tenant="alice", conversation="trip")
        result = await pipeline.run(request, policy)
        details = next(stage.details for stage in result.stages if stage.name == "conversation")
        rolled = max(rolled, details["carried_from"])
        messages.append({"role": "assistant", "content": "Noted, and the trams run every ten minutes."})
    assert rolled > 0, "the carried turns outgrew max_carried_tokens"
    assert counting.generate_calls == 0
