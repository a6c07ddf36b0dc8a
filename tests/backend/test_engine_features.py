"""Engine-level behaviour: prefix caching, int8 KV cache, abort, request validation, sampling."""

from __future__ import annotations

import pytest

from ctxgate.backend.engine.api import EngineError, GenerationRequest, SamplingParams
from tests.backend.engine_fixtures import PARITY_MAX_TOKENS

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SHARED_PREFIX = (
    "You are a helpful assistant. Answer the question using only the context below.\n"
    "Context: The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower.\n"
)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def run_to_completion(engine, request: GenerationRequest):
    engine.add_request(request)
    tokens, final = [], None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.request_id == request.request_id
            tokens.extend(delta.token_ids)
            if delta.finish_reason:
                final = delta
    return tokens, final


def test_prefix_cache_hit_gives_identical_output_and_salt_isolates(engine, tokenizer):
    prefix = tokenizer.encode(SHARED_PREFIX)
    assert len(prefix) >= 2 * 16 + 8
    question = tokenizer.encode("Question: Who designed the tower?\nAnswer:")
    first_tokens, first = run_to_completion(engine, GenerationRequest("p1", prefix + question, GREEDY))
    assert first.metrics.cached_prompt_tokens == 0
    hits_before = engine.stats().prefix_cache_hit_tokens
    second_tokens, second = run_to_completion(engine, GenerationRequest("p2", prefix + question, GREEDY))
    assert second.metrics.cached_prompt_tokens >= 32
    assert second_tokens == first_tokens
    assert engine.stats().prefix_cache_hit_tokens - hits_before == second.metrics.cached_prompt_tokens
    # Same prefix, another question: still hits the shared full blocks.
    other_question = tokenizer.encode("Question: Where is it?\nAnswer:")
    _, third = run_to_completion(engine, GenerationRequest("p3", prefix + other_question, GREEDY))
    assert third.metrics.cached_prompt_tokens >= 32
    # A different tenant salt never sees those blocks, yet computes the same answer.
    salted_tokens, salted = run_to_completion(
        engine, GenerationRequest("p4", prefix + question, GREEDY, cache_salt="tenant-b")
    )
    assert salted.metrics.cached_prompt_tokens == 0
    assert salted_tokens == first_tokens
    stats = engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_int8_kv_halves_bytes_and_stays_close(make_engine, parity_prompts):
    """int8 KV predicts the same greedy next token as bfloat16 KV for >= 90% of generated positions.

    Agreement is measured position by position on the full-precision continuation (each position
    gets the same prefix), because free-running greedy texts of a 135M model fork at near-ties:
    bfloat16 and float32 weights alone already diverge there, which says nothing about KV quality.
    """
    bf16 = make_engine(dtype="bfloat16", num_kv_blocks=96)
    int8 = make_engine(dtype="bfloat16", kv_cache_dtype="int8", num_kv_blocks=96)
    assert int8.stats().kv_bytes_per_token * 2 == bf16.stats().kv_bytes_per_token
    greedy = SamplingParams(max_tokens=PARITY_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = bf16.generate(parity_prompts, greedy)
    positions = [
        (prompt + continuation[:index], continuation[index])
        for prompt, continuation in zip(parity_prompts, reference, strict=True)
        for index in range(len(continuation))
    ]
    next_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    predicted = int8.generate([context for context, _ in positions], next_token)
    agree = sum(out == [expected] for out, (_, expected) in zip(predicted, positions, strict=True))
    assert agree / len(positions) >= 0.9, f"int8 KV agrees on {agree}/{len(positions)} tokens"
    assert int8.stats().num_kv_blocks_free == int8.stats().num_kv_blocks_total


def test_int8_pool_from_memory_holds_twice_the_blocks(make_engine):
    bf16 = make_engine(dtype="bfloat16", kv_cache_memory_mb=32)
    int8 = make_engine(dtype="bfloat16", kv_cache_dtype="int8", kv_cache_memory_mb=32)
    ratio = int8.stats().num_kv_blocks_total / bf16.stats().num_kv_blocks_total
    assert 1.9 <= ratio <= 2.05  # per-block scales cost a little; flooring to whole blocks too


def test_abort_frees_every_block_mid_prefill_and_mid_decode(make_engine, tokenizer):
    engine = make_engine(max_num_batched_tokens=16)
    total = engine.stats().num_kv_blocks_total
    long_prompt = tokenizer.encode(SHARED_PREFIX)  # several 16-token chunks
    engine.add_request(GenerationRequest("prefilling", long_prompt, GREEDY))
    engine.step()
    assert engine.stats().num_kv_blocks_free < total
    engine.abort_request("prefilling")
    assert engine.stats().num_kv_blocks_free == total
    assert not engine.has_unfinished_requests()

    engine.add_request(GenerationRequest("decoding", tokenizer.encode("Hello there"), GREEDY))
    engine.add_request(GenerationRequest("waiting", long_prompt, GREEDY))
    deltas = engine.step() + engine.step()
    assert any(d.request_id == "decoding" for d in deltas)
    engine.abort_request("decoding")
    engine.abort_request("decoding")  # idempotent
    engine.abort_request("never-existed")  # no-op
    engine.abort_request("waiting")
    assert engine.step() == []
    assert engine.stats().num_kv_blocks_free == total
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt, sampling, message",
    [
        ([], GREEDY, "empty"),
        ([1] * 5000, GREEDY, "context window"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1, 10**9], GREEDY, "token ids"),
    ],
)
def test_bad_requests_are_refused_with_400(engine, prompt, sampling, message):
    with pytest.raises(EngineError, match=message) as info:
        engine.add_request(GenerationRequest("bad", prompt, sampling))
    assert info.value.status_code == 400
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_is_refused(engine):
    engine.add_request(GenerationRequest("dup", [1, 2, 3], GREEDY))
    with pytest.raises(EngineError, match="duplicate"):
        engine.add_request(GenerationRequest("dup", [1, 2, 3], GREEDY))
    engine.abort_request("dup")


def test_max_tokens_is_clamped_to_the_context_window(make_engine):
    engine = make_engine(max_model_len=24)
    tokens, final = run_to_completion(
        engine,
        GenerationRequest("clamp", [1] * 20, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)),
    )
    assert len(tokens) == 4 and final.finish_reason == "length" and final.completion_tokens == 4


def test_seeded_sampling_is_reproducible_and_differs_by_seed(engine, tokenizer):
    prompt = tokenizer.encode("Write a word:")

    def sampled(seed: int) -> list[int]:
        params = SamplingParams(
            max_tokens=8, temperature=1.0, top_k=50, top_p=0.9, seed=seed, ignore_eos=True
        )
        return engine.generate([prompt], params)[0]

    assert sampled(1) == sampled(1)
    assert sampled(1) != sampled(2) or sampled(3) != sampled(1)


def test_stop_strings_and_stop_token_ids(engine, tokenizer):
    prompt = tokenizer.encode("Count: one, two, three, four,")
    free_run = engine.generate([prompt], GREEDY)[0]
    text = tokenizer.decode(free_run)
    assert len(text.strip()) > 3
    # Stop on a string that appears in the free-running output: text ends right before it.
    stop = text.strip()[:3]
    engine.add_request(
        GenerationRequest("stop-s", prompt, SamplingParams(max_tokens=8, temperature=0, stop=[stop]))
    )
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            streamed += delta.text
            final = delta if delta.finish_reason else final
    assert final.finish_reason == "stop"
    assert stop not in streamed and text.startswith(streamed)
    # Stop on the second generated token id: generation ends with it.
    params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[free_run[1]])
    assert engine.generate([prompt], params)[0] == free_run[: free_run.index(free_run[1]) + 1]


def test_streamed_text_matches_full_decode(engine, tokenizer):
    prompt = tokenizer.encode("Tell me about the sea.")
    engine.add_request(
        GenerationRequest("stream", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    )
    text, tokens, final = "", [], None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            text += delta.text
            tokens += delta.token_ids
            final = delta if delta.finish_reason else final
    assert text == tokenizer.decode(tokens)
    assert final.prompt_tokens == len(prompt) and final.completion_tokens == 12
    m = final.metrics
    assert m.ttft_ms > 0 and m.e2e_ms >= m.ttft_ms and m.tpot_ms > 0 and m.queue_ms >= 0


def test_the_between_layers_hook_runs_once_per_layer_and_leaves_output_alone(engine, tokenizer):
    """AsyncEngine.run_between_steps work starts between two decoder layers of a long step."""
    prompt = tokenizer.encode(SHARED_PREFIX + "Question: who designed the tower?")
    plain, _ = run_to_completion(engine, GenerationRequest("hook-off", prompt, GREEDY))
    calls = []
    engine.model.between_layers = lambda: calls.append(1)
    try:
        hooked, _ = run_to_completion(engine, GenerationRequest("hook-on", prompt, GREEDY))
    finally:
        engine.model.between_layers = None
    assert hooked == plain
    # one prefill step (the prompt fits one step's budget) and one per further token
    assert len(calls) == engine.model.config.num_layers * GREEDY.max_tokens
