import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ctxgate.compression.pipeline import PrefillCostEstimator
from ctxgate.compression.rendering import order_passages
from ctxgate.compression.state import Passage
from ctxgate.compression.types import BudgetExceededError, CompressionInput, Document
from ctxgate.policies.schema import Policy

DOCUMENTS = [
    Document(
        text=f"Town {name} has a population of {population}. It lies on the river {river}. Its mayor is {mayor}.",
        title=f"Town {name}",
    )
    for name, population, river, mayor in [
        ("Arlen", 1200, "Vey", "Ida Holm"),
        ("Brisk", 5400, "Orn", "Tomas Veld"),
        ("Cirra", 870, "Lune", "Mara Quist"),
        ("Dovel", 23000, "Sarn", "Pell Ochs"),
        ("Esker", 310, "Tay", "Una Brack"),
        ("Fallow", 4100, "Wend", "Rolf Jansk"),
    ]
]
MESSAGES = [
    {"role": "system", "content": "Answer from the documents only."},
    {"role": "user", "content": "Who is the mayor of Cirra?"},
]


async def test_stage_reports_reconcile_with_exact_counts(make_pipeline, tokenizer):
    policy = Policy(name="p", max_input_tokens=400, documents={"max_tokens": 60}, rerank={"top_k": 3})
    pipeline = make_pipeline()
    started = time.perf_counter()
    result = await pipeline.run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), policy)
    wall_ms = (time.perf_counter() - started) * 1000
    assert [s.name for s in result.stages] == [
        "cost-check",
        "history",
        "dedup",
        "rerank",
        "extraction",
        "assembly",
        "fit",
    ]
    assert sum(result.saved_tokens.values()) == result.original_prompt_tokens - result.prompt_tokens
    # Each stage is timed on its own: the stages that count, embed or render take measurable time,
    # and together they cannot take longer than the whole run.
    assert all(
        stage.ms > 0 for stage in result.stages if stage.name in ("cost-check", "rerank", "extraction", "fit")
    )
    assert sum(stage.ms for stage in result.stages) <= wall_ms
    assert "Mara Quist" in result.context_text
    assert result.messages[0] == MESSAGES[0]
    assert tokenizer.count(result.context_text) <= 60


async def test_original_tokens_are_the_full_uncompressed_prompt(make_pipeline, tokenizer):
    policy = Policy(name="off", max_input_tokens=2048, compression_enabled=False)
    result = await make_pipeline().run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), policy)
    assert result.original_prompt_tokens == result.prompt_tokens == tokenizer.count_chat(result.messages)
    for document in DOCUMENTS:
        assert document.text in result.context_text
    assert result.saved_tokens == {"cost-check": 0, "fit": 0}
    assert result.stages[0].details["skipped"] == "compression disabled by policy"


async def test_passthrough_over_budget_is_refused(make_pipeline):
    policy = Policy(name="off", max_input_tokens=64, documents={"max_tokens": 32}, compression_enabled=False)
    with pytest.raises(BudgetExceededError):
        await make_pipeline().run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), policy)


async def test_min_saving_skips_cheap_compression(make_pipeline):
    estimator = PrefillCostEstimator(ms_per_token=0.01)
    pipeline = make_pipeline(cost_estimator=estimator)
    policy = Policy(name="cheap", max_input_tokens=2048, min_saving_ms=50, rerank={"top_k": 2})
    request = CompressionInput(messages=MESSAGES, documents=DOCUMENTS)
    skipped = await pipeline.run(request, policy)
    assert skipped.prompt_tokens == skipped.original_prompt_tokens
    assert "min_saving_ms" in skipped.stages[0].details["skipped"]
    # Measured prefill gets expensive: the same request is now worth compressing.
    for _ in range(60):
        estimator.observe_prefill(prompt_tokens=100, prefill_ms=200)
    assert estimator.ms_per_token > 1.5
    compressed = await pipeline.run(request, policy)
    assert compressed.prompt_tokens < compressed.original_prompt_tokens


async def test_system_placement_and_trailing_messages(make_pipeline, tokenizer):
    policy = Policy(
        name="sys", max_input_tokens=300, documents={"max_tokens": 150}, assembly={"placement": "system"}
    )
    messages = MESSAGES + [{"role": "assistant", "content": "The mayor is"}]
    result = await make_pipeline().run(CompressionInput(messages=messages, documents=DOCUMENTS), policy)
    assert result.messages[0] == MESSAGES[0]
    assert result.messages[1]["role"] == "system" and result.messages[1]["content"].startswith("Documents:")
    assert result.messages[-2:] == messages[-2:]
    assert result.prompt_tokens == tokenizer.count_chat(result.messages) <= 300


def test_reorder_best_at_ends():
    passages = [
        Passage(document=Document(text=str(i)), position=i, score=s)
        for i, s in enumerate([0.1, 0.9, 0.5, 0.7, 0.3])
    ]
    assert [p.score for p in order_passages(passages, "best-first")] == [0.9, 0.7, 0.5, 0.3, 0.1]
    assert [p.score for p in order_passages(passages, "best-at-ends")] == [0.9, 0.5, 0.1, 0.3, 0.7]
    assert [p.position for p in order_passages(passages, "original")] == [0, 1, 2, 3, 4]


async def test_no_user_message_is_a_value_error(make_pipeline):
    with pytest.raises(ValueError, match="user message"):
        await make_pipeline().run(
            CompressionInput(messages=[{"role": "system", "content": "x"}]), Policy(name="p")
        )


def test_stable_order_depends_on_content_only():
    def passage(text: str, position: int, score: float) -> Passage:
        return Passage(document=Document(text=text), position=position, score=score)

    shared = ["Ida Holm is mayor.", "The Vey runs north.", "Brisk has 5400 people."]
    first = [
        passage(t, i, s)
        for i, (t, s) in enumerate(zip([*shared, "only in A"], [0.1, 0.9, 0.5, 0.7], strict=True))
    ]
    second = [
        passage(t, i, s)
        for i, (t, s) in enumerate(zip(["only in B", *shared[::-1]], [0.3, 0.2, 0.8, 0.6], strict=True))
    ]
    order_a = [p.document.text for p in order_passages(first, "stable")]
    order_b = [p.document.text for p in order_passages(second, "stable")]
    assert [t for t in order_a if t in shared] == [t for t in order_b if t in shared]


async def test_stable_assembly_gives_requests_with_the_same_kept_passages_the_same_block(make_pipeline):
    policy = Policy(
        name="s",
        max_input_tokens=4000,
        documents={"max_tokens": 4000},
        rerank={"enabled": False},
        assembly={"order": "stable"},
    )
    pipeline = make_pipeline()
    forward = await pipeline.run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), policy)
    backward = await pipeline.run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS[::-1]), policy)
    assert forward.messages == backward.messages


@contextmanager
def model_calls(embedder) -> Iterator[list[int]]:
    """The number of texts of each model call the embedder makes meanwhile. `_encode` is where every
    cache miss goes, whichever route the call then takes: the shared embedder may carry a batching
    thread or an engine runner from a gateway another test built, and those hold `_encode_now` bound
    at their creation, where an instance patch would not reach."""
    calls: list[int] = []
    encode = embedder._encode

    def counting(texts, *args, **kwargs):
        calls.append(len(texts))
        return encode(texts, *args, **kwargs)

    embedder._encode = counting
    try:
        yield calls
    finally:
        del embedder._encode


async def test_first_sight_embeds_question_and_candidates_in_one_model_call(make_pipeline, embedder):
    # Every model call has a fixed cost (and in the gateway a round trip to the embedding process),
    # so the question rides with the candidate sentences instead of going alone.
    documents = [
        Document(text=d.text.replace("Town", "Village"), title=d.title.replace("Town", "Hamlet"))
        for d in DOCUMENTS
    ]  # texts this session's embedder has not cached
    policy = Policy(name="p", max_input_tokens=400, documents={"max_tokens": 60}, rerank={"top_k": 3})
    question = {"role": "user", "content": "Who is the mayor of the village of Cirra, please?"}
    with model_calls(embedder) as calls:
        result = await make_pipeline().run(
            CompressionInput(messages=[MESSAGES[0], question], documents=documents), policy
        )
    assert "Mara Quist" in result.context_text
    assert len(calls) == 1 and calls[0] > len(documents)


async def test_a_smaller_first_sight_allowance_embeds_fewer_texts(make_pipeline, embedder):
    # documents.embed_budget_multiple / embed_min_share: the policy's trade of first-sight CPU
    # against the embedding scores of the sentences the lexical pre-filter ranks lower.
    question = {"role": "user", "content": "Who is the mayor of the town of Cirra, please?"}

    async def texts_embedded(budget_multiple: float, tag: str) -> tuple[int, str]:
        documents = [
            Document(text=d.text.replace("Town", tag), title=d.title.replace("Town", tag)) for d in DOCUMENTS
        ]
        policy = Policy(
            name="p",
            max_input_tokens=400,
            rerank={"top_k": 3},
            documents={"max_tokens": 60, "embed_budget_multiple": budget_multiple, "embed_min_share": 0},
        )
        with model_calls(embedder) as calls:
            result = await make_pipeline().run(
                CompressionInput(messages=[MESSAGES[0], question], documents=documents), policy
            )
        return sum(calls), result.context_text

    wide, wide_context = await texts_embedded(4.0, "Borough")
    narrow, narrow_context = await texts_embedded(0.2, "Parish")
    assert narrow < wide
    assert "Mara Quist" in wide_context and "Mara Quist" in narrow_context


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("enabled", [True, False])
async def test_prepare_runs_off_the_event_loop(make_pipeline, workers, enabled):
    """The gateway's neutraliser reads the whole request's text: `prepare` runs in the compression
    worker (or a thread of its own), never on the caller's event loop, and its output is compressed."""
    import threading

    pipeline = make_pipeline(workers=workers)
    loop_thread = threading.current_thread()
    seen: list[threading.Thread] = []

    def prepare(request: CompressionInput) -> CompressionInput:
        seen.append(threading.current_thread())
        return CompressionInput(
            messages=request.messages, documents=[Document(text="Mayor Mara Quist of Cirra.")]
        )

    policy = Policy(name="p", max_input_tokens=400, documents={"max_tokens": 60}, compression_enabled=enabled)
    try:
        result = await pipeline.run(
            CompressionInput(messages=MESSAGES, documents=DOCUMENTS), policy, prepare=prepare
        )
    finally:
        pipeline.close()
    assert len(seen) == 1 and seen[0] is not loop_thread
    assert "Mara Quist" in result.context_text and "Tomas Veld" not in result.context_text
