"""The embedding micro-batcher and the compression workers: concurrent calls are coalesced into one
model call, every caller gets its own rows (or the error), and requests that compress nothing
never wait behind a busy compression worker."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from ctxgate.compression.embedding.batching import EmbedBatcher
from ctxgate.compression.types import CompressionInput, Document
from ctxgate.policies.schema import Policy
from tests.support.waiting import eventually


class RecordingEncode:
    """A deterministic encoder (row = text length and first letter) that records each model call;
    the first call can be held until the test lets it go."""

    def __init__(self, hold_first: bool = False):
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        if not hold_first:
            self.release.set()

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.calls.append(list(texts))
        if len(self.calls) == 1:
            self.release.wait(timeout=30)
        return np.array([[len(text), ord(text[0])] for text in texts], dtype=np.float32)


def wait_until(condition, timeout_s: float = 30.0) -> None:
    eventually(condition, timeout_s=timeout_s, interval_s=0.005)


def test_calls_waiting_while_the_model_runs_share_one_batch_and_each_gets_its_rows():
    encode = RecordingEncode(hold_first=True)
    batcher = EmbedBatcher(encode, window_ms=0)
    inputs = [["alpha"], ["beta", "gamma"], ["delta", "alpha"], ["epsilon"]]
    results: dict[int, np.ndarray] = {}

    def call(index: int) -> None:
        results[index] = batcher.encode(inputs[index])

    first = threading.Thread(target=call, args=(0,))
    first.start()
    wait_until(lambda: len(encode.calls) == 1)  # the model is busy with the first call
    others = [threading.Thread(target=call, args=(i,)) for i in (1, 2, 3)]
    for thread in others:
        thread.start()
    wait_until(lambda: batcher._calls.qsize() == 3)
    encode.release.set()
    for thread in [first, *others]:
        thread.join(timeout=30)
    batcher.close()
    assert encode.calls == [["alpha"], ["beta", "gamma", "delta", "alpha", "epsilon"]]
    assert (batcher.batches, batcher.calls) == (2, 4)
    for index, texts in enumerate(inputs):
        expected = np.array([[len(t), ord(t[0])] for t in texts], dtype=np.float32)
        np.testing.assert_array_equal(results[index], expected)


def test_a_failing_model_call_reaches_every_caller_of_the_batch_and_the_batcher_survives():
    def broken(texts: list[str]) -> np.ndarray:
        if "boom" in texts:
            raise RuntimeError("model failed")
        return np.ones((len(texts), 2), dtype=np.float32)

    batcher = EmbedBatcher(broken, window_ms=0)
    with pytest.raises(RuntimeError, match="model failed"):
        batcher.encode(["boom"])
    assert batcher.encode(["fine"]).shape == (1, 2)
    batcher.close()


def test_batched_vectors_equal_the_models_own(embedder):
    texts = ["The river Vey runs north.", "Ida Holm is the mayor of Arlen.", "The river Vey runs north."]
    batcher = EmbedBatcher(embedder._encode_now, window_ms=1)
    try:
        batched, alone = batcher.encode(texts), embedder._encode_now(texts)
        # bfloat16 sums depend on the batch's shape and thread count (the batcher dedups and runs
        # with its own OpenMP budget); the vectors stay the same ones.
        atol = 1e-2 if embedder.precision == "bfloat16" else 1e-5
        np.testing.assert_allclose(batched, alone, atol=atol)
        assert (batched * alone).sum(axis=1).min() > 0.999
    finally:
        batcher.close()


DOCUMENTS = [
    Document(text=f"Town {i} lies on river R{i}. Its mayor is M{i}. It has {i}00 people.", title=f"T{i}")
    for i in range(8)
]
MESSAGES = [
    {"role": "system", "content": "Answer."},
    {"role": "user", "content": "Who is the mayor of Town 3?"},
]
COMPRESSING = Policy(name="c", max_input_tokens=400, documents={"max_tokens": 60}, rerank={"top_k": 3})
PASSTHROUGH = Policy(name="p", max_input_tokens=4000, compression_enabled=False)


async def test_worker_compression_gives_the_same_prompt_as_inline(make_pipeline):
    inline = await make_pipeline().run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), COMPRESSING)
    pipeline = make_pipeline(workers=1)
    try:
        in_worker = await pipeline.run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), COMPRESSING)
    finally:
        pipeline.close()
    assert in_worker.messages == inline.messages
    assert in_worker.prompt_tokens == inline.prompt_tokens < inline.original_prompt_tokens


def occupy_the_worker(pipeline) -> threading.Event:
    """Keep the pipeline's only compression worker busy until the returned event is set."""
    busy, release = threading.Event(), threading.Event()

    def occupy() -> None:
        busy.set()
        release.wait(timeout=60)

    pipeline._executor.submit("anonymous", occupy)  # the tenant the requests below are
    busy.wait(timeout=30)
    return release


async def test_passthrough_does_not_wait_for_a_busy_compression_worker(make_pipeline):
    pipeline = make_pipeline(workers=1)
    release = occupy_the_worker(pipeline)
    try:
        compressing = asyncio.ensure_future(
            pipeline.run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), COMPRESSING)
        )
        passthrough = await asyncio.wait_for(
            pipeline.run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), PASSTHROUGH), timeout=60
        )
        assert passthrough.prompt_tokens == passthrough.original_prompt_tokens
        assert not compressing.done()  # still queued behind the occupied worker
    finally:
        release.set()
    assert (await compressing).prompt_tokens < passthrough.prompt_tokens
    pipeline.close()


async def test_the_wait_for_a_busy_worker_is_reported_apart_from_the_stages(make_pipeline):
    pipeline = make_pipeline(workers=1)
    release = occupy_the_worker(pipeline)
    try:
        queued = asyncio.ensure_future(
            pipeline.run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), COMPRESSING)
        )
        await asyncio.sleep(0.3)  # the worker stays busy at least this long after the request came
    finally:
        release.set()
    waited = await queued
    alone = await pipeline.run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), COMPRESSING)
    passthrough = await pipeline.run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), PASSTHROUGH)
    pipeline.close()
    assert waited.wait_ms >= 300 > alone.wait_ms
    assert passthrough.wait_ms == 0.0  # passthrough never queues for a worker


# -- EngineJobBatcher: calls waiting for the engine's thread share one forward pass ------------------


def packed(*sentences: list[int]):
    """A PackedBatch of sentences given as token ids."""
    import torch

    from ctxgate.compression.embedding.packed_encoder import PackedBatch

    flat = [token for sentence in sentences for token in sentence]
    positions = [position for sentence in sentences for position in range(len(sentence))]
    return PackedBatch(torch.tensor(flat), torch.tensor(positions), [len(sentence) for sentence in sentences])


class RecordingForward:
    """A deterministic forward pass (row = sentence length and first token) that records its batches."""

    def __init__(self):
        self.batches: list[list[int]] = []

    def __call__(self, batch) -> np.ndarray:
        self.batches.append(list(batch.lengths))
        rows, start = [], 0
        for length in batch.lengths:
            rows.append([length, int(batch.input_ids[start])])
            start += length
        return np.array(rows, dtype=np.float32)


class HeldRunner:
    """A one-thread runner (the engine thread's stand-in) that can be held busy by a first job."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.executor = ThreadPoolExecutor(max_workers=1)
        self.release = threading.Event()
        self.executor.submit(self.release.wait, 30)
        self.jobs = 0

    def __call__(self, fn):
        self.jobs += 1
        return self.executor.submit(fn)


def call_in_threads(batcher, batches: list) -> tuple[dict[int, np.ndarray], list[threading.Thread]]:
    results: dict[int, np.ndarray] = {}

    def call(index: int) -> None:
        results[index] = batcher.encode(batches[index])

    threads = [threading.Thread(target=call, args=(index,)) for index in range(len(batches))]
    for thread in threads:
        thread.start()
    return results, threads


def test_calls_waiting_for_the_engine_share_one_forward_pass_and_each_gets_its_rows():
    from ctxgate.compression.embedding.batching import EngineJobBatcher

    runner, forward = HeldRunner(), RecordingForward()
    batcher = EngineJobBatcher(runner, forward, max_tokens=100)
    batches = [packed([5, 1, 1]), packed([7, 1], [8, 1, 1, 1]), packed([9])]
    results, threads = call_in_threads(batcher, batches)
    wait_until(lambda: runner.jobs == 3)  # every call queued its job behind the held one
    runner.release.set()
    for thread in threads:
        thread.join(timeout=30)
    assert len(forward.batches) == 1 and sorted(forward.batches[0]) == [1, 2, 3, 4]
    assert (batcher.batches, batcher.calls) == (1, 3)
    np.testing.assert_array_equal(results[0], [[3, 5]])
    np.testing.assert_array_equal(results[1], [[2, 7], [4, 8]])
    np.testing.assert_array_equal(results[2], [[1, 9]])
    runner.executor.shutdown()


def test_a_shared_pass_stops_at_max_tokens_and_the_rest_runs_in_the_next():
    from ctxgate.compression.embedding.batching import EngineJobBatcher

    runner, forward = HeldRunner(), RecordingForward()
    batcher = EngineJobBatcher(runner, forward, max_tokens=6)
    batches = [packed([1, 1, 1, 1]), packed([2, 2, 2]), packed([3, 3])]
    results, threads = call_in_threads(batcher, batches)
    wait_until(lambda: runner.jobs == 3)
    runner.release.set()
    for thread in threads:
        thread.join(timeout=30)
    assert sum(len(lengths) for lengths in forward.batches) == 3 and len(forward.batches) == 2
    assert all(sum(lengths) <= 6 for lengths in forward.batches)
    assert {index: rows[0][1] for index, rows in results.items()} == {0: 1, 1: 2, 2: 3}
    runner.executor.shutdown()


def test_a_call_larger_than_max_tokens_still_runs_alone():
    from ctxgate.compression.embedding.batching import EngineJobBatcher

    forward = RecordingForward()
    batcher = EngineJobBatcher(lambda fn: _done(fn), forward, max_tokens=2)
    np.testing.assert_array_equal(batcher.encode(packed([4, 4, 4, 4, 4])), [[5, 4]])
    assert forward.batches == [[5]]


def _done(fn):
    """A runner that runs the job at once, on the calling thread (as the engine does for its own thread)."""
    from concurrent.futures import Future

    future: Future = Future()
    fn()
    future.set_result(None)
    return future


def test_a_job_run_at_once_answers_its_own_call_before_older_waiting_ones():
    """Asked from the engine's thread, the job runs inline: it must answer the call that waits on it
    even when older calls fill the pass (else that thread would wait for itself)."""
    from concurrent.futures import Future

    from ctxgate.compression.embedding.batching import EngineJobBatcher

    forward = RecordingForward()
    parked: list = []

    def runner(fn):
        if not parked:  # the first job stays queued, like one behind a busy engine
            parked.append(fn)
            return Future()
        return _done(fn)

    batcher = EngineJobBatcher(runner, forward, max_tokens=4)
    older, _ = call_in_threads(batcher, [packed([1, 1, 1, 1])])
    wait_until(lambda: len(parked) == 1)
    np.testing.assert_array_equal(batcher.encode(packed([2, 2])), [[2, 2]])
    assert forward.batches == [[2]]
    parked[0]()  # the queued job runs later and answers the older call
    wait_until(lambda: 0 in older)
    np.testing.assert_array_equal(older[0], [[4, 1]])


def test_a_runner_that_refuses_or_drops_the_job_fails_only_its_own_call():
    from concurrent.futures import Future

    from ctxgate.compression.embedding.batching import EngineJobBatcher

    def refusing(fn):
        raise ConnectionError("engine gone")

    with pytest.raises(ConnectionError, match="engine gone"):
        EngineJobBatcher(refusing, RecordingForward(), max_tokens=10).encode(packed([1]))

    def dropping(fn):  # queued, then failed without running (the engine shut down meanwhile)
        future: Future = Future()
        future.set_exception(ConnectionError("engine stopped"))
        return future

    batcher = EngineJobBatcher(dropping, RecordingForward(), max_tokens=10)
    with pytest.raises(ConnectionError, match="engine stopped"):
        batcher.encode(packed([1]))
    assert batcher._pending == []


def test_a_failing_forward_pass_reaches_every_call_it_held():
    from ctxgate.compression.embedding.batching import EngineJobBatcher

    def broken(batch):
        raise RuntimeError("forward failed")

    runner = HeldRunner()
    batcher = EngineJobBatcher(runner, broken, max_tokens=100)
    errors: list[str] = []

    def call(batch) -> None:
        try:
            batcher.encode(batch)
        except RuntimeError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=call, args=(packed([index + 1]),)) for index in range(3)]
    for thread in threads:
        thread.start()
    wait_until(lambda: runner.jobs == 3)
    runner.release.set()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == ["forward failed"] * 3
    runner.executor.shutdown()
