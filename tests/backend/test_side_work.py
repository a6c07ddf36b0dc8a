"""Side work on the engine thread takes at most its share of the thread's time while the engine is
busy (backend/engine/side_work.py), and all of it when the engine is idle."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from ctxgate.backend.engine.api import GenerationRequest, SamplingParams
from ctxgate.backend.engine.side_work import MAX_CREDIT_S, SIDE_WORK_SHARE, Job, SideWorkQueue


def _queue_of(count: int, seconds: float = 0.0) -> tuple[SideWorkQueue, list[Job]]:
    work = SideWorkQueue(share=0.25, max_credit_s=0.05)
    jobs = [Job(lambda: time.sleep(seconds)) for _ in range(count)]
    for job in jobs:
        work.put(job)
    return work, jobs


def test_an_idle_engine_runs_every_queued_job():
    work, jobs = _queue_of(5)
    work.run_pending()
    assert work.jobs_run == 5 and all(job.future.done() for job in jobs) and not work.pending


def test_a_busy_engine_runs_jobs_on_the_credit_its_steps_earn():
    work, _ = _queue_of(4, seconds=0.06)
    work.busy = True
    work.run_pending()  # the banked credit (0.05 s) pays for one job, which overdraws it
    assert work.jobs_run == 1 and work.pending
    work.run_pending()
    assert work.jobs_run == 1  # in debt: nothing runs until steps pay it off
    work.earn(0.01)  # a step of 10 ms earns a third of it: still in debt
    work.run_pending()
    assert work.jobs_run == 1
    work.earn(1.0)  # credit is banked up to 50 ms only
    work.run_pending()
    assert work.jobs_run == 2
    work.busy = False  # the engine went idle: the rest runs at once
    work.run_pending()
    assert work.jobs_run == 4 and not work.pending


def test_a_share_outside_zero_and_one_is_refused():
    with pytest.raises(ValueError, match="share"):
        SideWorkQueue(share=1.0)


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
        max_num_seqs=2,
        max_model_len=256,
    )
    async_engine = AsyncEngine(config)
    yield async_engine
    async_engine.shutdown()


async def test_a_flood_of_side_work_does_not_stall_a_running_stream(engine):
    """Sixty 50 ms jobs queued while a 150-token answer streams: while the engine is busy, side work
    takes about its share of the engine thread's time (without the share every job would run at the
    next safe point: 3 s before the next token); once the engine is idle the rest run."""
    job_s = 0.05
    prompt = engine.tokenizer.encode("Count slowly: one, two, three,")
    request = GenerationRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=150, temperature=0, ignore_eos=True),
    )
    ran_while_busy: list[bool] = []

    def job() -> None:  # on the engine thread: whether a request was running when it ran
        ran_while_busy.append(engine.engine.has_unfinished_requests())
        time.sleep(job_s)

    stream = engine.generate(request)
    first = await anext(stream)  # the request is running: the engine is busy
    queued_at = time.perf_counter()
    futures = [engine.run_between_steps(job) for _ in range(60)]
    tokens = len(first.token_ids) + sum([len(delta.token_ids) async for delta in stream])
    busy_s = time.perf_counter() - queued_at
    assert tokens == 150
    await asyncio.wait_for(asyncio.gather(*map(asyncio.wrap_future, futures)), timeout=60)
    assert len(ran_while_busy) == 60
    side_while_busy_s = sum(ran_while_busy) * job_s
    # The share of the busy time, plus the banked credit and one job's overdraft.
    assert side_while_busy_s <= SIDE_WORK_SHARE * busy_s + MAX_CREDIT_S + job_s + 0.05, (
        side_while_busy_s,
        busy_s,
    )
