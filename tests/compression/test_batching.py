"""The embedding micro-batcher and the compression workers: concurrent calls are coalesced into one
model call, every caller gets its own rows (or the error), and requests that compress nothing
never wait behind a busy compression worker."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from compression.batching import EmbedBatcher
from compression.types import CompressionInput, Document
from policies.schema import Policy


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
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


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


DOCUMENTS = [Document(text=f"Town {i} lies on river R{i}. Its mayor is M{i}. It has {i}00 people.", title=f"T{i}")
             for i in range(8)]
MESSAGES = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "Who is the mayor of Town 3?"}]
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


async def test_passthrough_does_not_wait_for_a_busy_compression_worker(make_pipeline):
    pipeline = make_pipeline(workers=1)
    busy = threading.Event()
    release = threading.Event()

    def occupy() -> None:
        busy.set()
        release.wait(timeout=60)

    pipeline._executor.submit(occupy)
    busy.wait(timeout=30)
    try:
        compressing = asyncio.ensure_future(
            pipeline.run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), COMPRESSING))
        passthrough = await asyncio.wait_for(
            pipeline.run(CompressionInput(messages=MESSAGES, documents=DOCUMENTS), PASSTHROUGH), timeout=60)
        assert passthrough.prompt_tokens == passthrough.original_prompt_tokens
        assert not compressing.done()  # still queued behind the occupied worker
    finally:
        release.set()
    assert (await compressing).prompt_tokens < passthrough.prompt_tokens
    pipeline.close()
