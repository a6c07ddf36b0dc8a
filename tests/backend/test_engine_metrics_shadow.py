"""A shadow request (Priority.SHADOW) is in none of the engine's live figures: TTFT, latency,
token and request counters, TTFT target misses; it is counted in `ctxgate:shadow_requests` alone."""

from __future__ import annotations

import uuid

import pytest

from ctxgate.backend.engine.api import GenerationRequest, Priority, SamplingParams
from tests.support.metrics import metric_value

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def engine(model_dir):
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig

    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        block_size=16,
        num_kv_blocks=64,
        max_num_batched_tokens=128,
        max_num_seqs=4,
        max_model_len=256,
        ttft_target_ms=0.001,  # every request misses it: the misses counter counts requests
    )
    async_engine = AsyncEngine(config)
    yield async_engine
    async_engine.shutdown()


def _request(engine, text: str, priority: Priority) -> GenerationRequest:
    return GenerationRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=engine.tokenizer.encode(text),
        sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
        priority=priority,
    )


def _figures(engine) -> dict[str, float]:
    text = engine.metrics.render().decode()
    names = (
        "ctxgate:time_to_first_token_seconds_count",
        "ctxgate:e2e_request_latency_seconds_count",
        "ctxgate:request_queue_time_seconds_count",
        "ctxgate:inter_token_latency_seconds_count",
        "ctxgate:request_prompt_tokens_sum",
        "ctxgate:generation_tokens_total",
        "ctxgate:prompt_tokens_total",
        "ctxgate:request_success_total",
        "ctxgate:ttft_target_misses_total",
        "ctxgate:shadow_requests_total",
    )
    return {name: metric_value(text, name) for name in names}


async def _run(engine, request: GenerationRequest) -> None:
    deltas = [delta async for delta in engine.generate(request)]
    assert deltas[-1].finish_reason == "length"


async def test_a_shadow_request_is_counted_apart_from_the_live_figures(engine):
    live = _request(engine, "The capital of France is", Priority.USER)
    await _run(engine, live)
    after_live = _figures(engine)
    prompt = len(live.prompt_token_ids)
    assert after_live["ctxgate:time_to_first_token_seconds_count"] == 1
    assert after_live["ctxgate:inter_token_latency_seconds_count"] == MAX_TOKENS - 1
    assert after_live["ctxgate:generation_tokens_total"] == MAX_TOKENS
    assert after_live["ctxgate:request_prompt_tokens_sum"] == prompt
    assert after_live["ctxgate:ttft_target_misses_total"] == 1
    assert after_live["ctxgate:shadow_requests_total"] == 0

    await _run(
        engine, _request(engine, "A much longer prompt that the shadow replays in full:", Priority.SHADOW)
    )
    after_shadow = _figures(engine)
    assert after_shadow["ctxgate:shadow_requests_total"] == 1
    assert (
        metric_value(
            engine.metrics.render().decode(), "ctxgate:shadow_requests_total", finished_reason="length"
        )
        == 1
    )
    unchanged = {
        name: value for name, value in after_shadow.items() if name != "ctxgate:shadow_requests_total"
    }
    assert unchanged == {
        name: value for name, value in after_live.items() if name != "ctxgate:shadow_requests_total"
    }


async def test_an_aborted_shadow_request_is_not_a_live_abort(engine):
    before = _figures(engine)
    request = _request(engine, "Tell a long story:", Priority.SHADOW)
    stream = engine.generate(request)
    await stream.__anext__()
    await engine.abort(request.request_id)
    async for _ in stream:
        pass
    after = _figures(engine)
    assert after["ctxgate:shadow_requests_total"] == before["ctxgate:shadow_requests_total"] + 1
    assert after["ctxgate:request_success_total"] == before["ctxgate:request_success_total"]
