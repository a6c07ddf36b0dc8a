"""AsyncEngine driven directly from asyncio: streaming, abort, refusals, the bounded waiting queue."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from ctxgate.backend.engine.api import EngineError, GenerationRequest, SamplingParams
from tests.support.metrics import metric_value
from tests.support.waiting import wait_until_engine_idle


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
        max_num_seqs=1,
        max_model_len=256,
    )
    async_engine = AsyncEngine(config, max_waiting_requests=1)
    yield async_engine
    async_engine.shutdown()


def _request(engine, text: str, max_tokens: int, ignore_eos: bool = True) -> GenerationRequest:
    return GenerationRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=engine.tokenizer.encode(text),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos),
    )


async def test_generate_streams_to_a_final_delta(engine):
    request = _request(engine, "Count: one, two,", max_tokens=5)
    deltas = [delta async for delta in engine.generate(request)]
    assert sum(len(d.token_ids) for d in deltas) == 5
    final = deltas[-1]
    assert final.finish_reason == "length" and final.completion_tokens == 5
    assert final.prompt_tokens == len(request.prompt_token_ids)
    assert final.metrics is not None and final.metrics.ttft_ms > 0
    assert all(d.finish_reason is None for d in deltas[:-1])
    wait_until_engine_idle(engine)


async def test_explicit_abort_ends_the_stream_and_frees_blocks(engine):
    request = _request(engine, "A long tale:", max_tokens=200)
    deltas = []
    async for delta in engine.generate(request):
        deltas.append(delta)
        if len(deltas) == 2:
            await engine.abort(request.request_id)
    assert deltas[-1].finish_reason == "abort"
    assert sum(len(d.token_ids) for d in deltas) < 200
    await asyncio.to_thread(wait_until_engine_idle, engine)


async def test_consumer_leaving_aborts(engine):
    await asyncio.to_thread(wait_until_engine_idle, engine)
    before = _finished_counts(engine)
    request = _request(engine, "Another long tale:", max_tokens=200)
    stream = engine.generate(request)
    await stream.__anext__()
    await stream.aclose()  # what a disconnecting HTTP client does to the server's generator
    # A free pool alone would also follow a request that ran all 200 tokens: the counters tell
    # that the engine aborted it, and the token count that it stopped early.
    await asyncio.to_thread(wait_until_engine_idle, engine)
    after = _finished_counts(engine)
    assert after["abort"] == before["abort"] + 1
    assert after["length"] == before["length"] and after["stop"] == before["stop"]
    assert after["generated_tokens"] - before["generated_tokens"] < 200


def _finished_counts(engine) -> dict[str, float]:
    """Requests finished per reason, and tokens generated, from the engine's Prometheus metrics."""
    exposition = engine.metrics.render().decode()
    counts = {
        reason: metric_value(exposition, "ctxgate:request_success_total", finished_reason=reason)
        for reason in ("stop", "length", "abort")
    }
    counts["generated_tokens"] = metric_value(exposition, "ctxgate:generation_tokens_total")
    return counts


async def test_engine_error_surfaces_before_any_delta(engine):
    too_long = GenerationRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=[1] * (engine.max_model_len + 10),
        sampling=SamplingParams(max_tokens=4),
    )
    with pytest.raises(EngineError) as excinfo:
        await engine.add_request(too_long)
    assert excinfo.value.status_code == 400
    received = []
    with pytest.raises(EngineError):
        async for delta in engine.generate(too_long):
            received.append(delta)
    assert received == []


async def test_bounded_waiting_queue_refuses_with_503(engine):
    # One sequence runs at a time and one may wait, so of three long requests one is refused.
    requests = [_request(engine, f"Story number {i}:", max_tokens=24) for i in range(3)]

    async def run(request):
        try:
            return [d async for d in engine.generate(request)][-1].finish_reason
        except EngineError as exc:
            return exc.status_code

    outcomes = await asyncio.gather(*(run(r) for r in requests))
    assert outcomes.count(503) >= 1
    assert "length" in outcomes
    await asyncio.to_thread(wait_until_engine_idle, engine)


async def test_idle_engine_thread_sleeps(engine):
    await asyncio.to_thread(wait_until_engine_idle, engine)
    thread_ids = {engine._thread.native_id}
    before = _thread_cpu_seconds(thread_ids)
    await asyncio.sleep(0.5)
    assert _thread_cpu_seconds(thread_ids) - before < 0.05


def _thread_cpu_seconds(native_ids: set[int]) -> float:
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for tid in native_ids:
        with open(f"/proc/self/task/{tid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


async def test_jobs_run_on_the_engine_thread_between_steps(engine):
    """A job runs on the engine's own thread (between steps or decoder layers, never inside an op)
    while a request streams; the stream goes on after it, whole."""
    import threading

    request = _request(engine, "A long tale:", max_tokens=40)
    job_threads: list[str] = []
    deltas = []

    def job() -> str:
        job_threads.append(threading.current_thread().name)
        return "done"

    async for delta in engine.generate(request):
        deltas.append(delta)
        if len(deltas) == 2:
            assert await asyncio.wrap_future(engine.run_between_steps(job)) == "done"
    assert job_threads == ["ctxgate-engine"]
    assert deltas[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in deltas) == 40
    await asyncio.to_thread(wait_until_engine_idle, engine)


async def test_a_failing_job_fails_its_future_not_the_engine(engine):
    def broken() -> None:
        raise ValueError("bad job")

    with pytest.raises(ValueError, match="bad job"):
        await asyncio.wrap_future(engine.run_between_steps(broken))
    assert engine.is_ready()
    deltas = [d async for d in engine.generate(_request(engine, "Still there?", max_tokens=3))]
    assert deltas[-1].finish_reason == "length"


def test_jobs_are_refused_after_shutdown(model_dir):
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig

    config = EngineConfig(
        model=str(model_dir), dtype="float32", block_size=16, num_kv_blocks=16, max_model_len=128
    )
    stopped = AsyncEngine(config)
    assert stopped.run_between_steps(lambda: 41 + 1).result(timeout=30) == 42
    stopped.shutdown()
    with pytest.raises(EngineError) as refused:
        stopped.run_between_steps(lambda: None)
    assert refused.value.status_code == 503


async def test_a_job_that_asks_for_a_job_gets_it_run_inline(engine):
    def outer() -> int:
        return engine.run_between_steps(lambda: 7).result(timeout=5) * 6

    assert await asyncio.wrap_future(engine.run_between_steps(outer)) == 42


async def test_the_wait_for_the_engine_thread_counts_as_queue_time(engine):
    """The engine thread takes requests between steps: one submitted while it is busy (here a job
    stands in for a long prefill step) waits, and its queue time and TTFT include the wait."""
    import threading
    import time

    busy = threading.Event()

    def hold_the_thread() -> None:
        busy.set()
        time.sleep(0.3)

    held = engine.run_between_steps(hold_the_thread)
    await asyncio.to_thread(busy.wait, 30)
    deltas = [d async for d in engine.generate(_request(engine, "Queued:", max_tokens=2))]
    held.result(timeout=30)
    metrics = deltas[-1].metrics
    assert metrics is not None
    assert metrics.queue_ms >= 250, metrics
    assert metrics.ttft_ms >= metrics.queue_ms + metrics.prefill_ms * 0.99
