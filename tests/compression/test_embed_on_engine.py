"""The embedding model's forward passes on the in-process engine's thread, between its steps
(Embedder.use_runner + AsyncEngine.run_between_steps): same vectors, and an engine that is gone
costs nothing but the move back in process."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.support.waiting import eventually

TEXTS = ["The river Vey runs north.", "Ida Holm is the mayor of Arlen.", "Photosynthesis needs light."]


@pytest.fixture
def engine(model_dir):
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig

    config = EngineConfig(
        model=str(model_dir), dtype="float32", block_size=16, num_kv_blocks=32, max_model_len=256
    )
    async_engine = AsyncEngine(config)
    yield async_engine
    async_engine.shutdown()


@pytest.fixture
def own_embedder(embedder):
    """A model of its own (not the session's shared one), so runners set here stay here."""
    from ctxgate.compression.embedding.embeddings import Embedder

    return Embedder(embedder.model_path, precision=embedder.precision)


def test_forward_passes_run_as_engine_jobs_with_the_same_vectors(engine, own_embedder):
    in_process = own_embedder._encode_now(TEXTS)
    own_embedder.use_runner(engine.run_between_steps)
    on_engine = own_embedder._encode_now(TEXTS)
    assert engine.jobs_run == 1
    assert on_engine.shape == in_process.shape and on_engine.dtype == np.float32
    # The engine thread computes with its own OpenMP team (2 threads here, 1 above): same vectors.
    assert (on_engine * in_process).sum(axis=1).min() > 0.9999


def test_an_engine_that_shut_down_sends_the_model_back_in_process(engine, own_embedder):
    runner = engine.run_between_steps
    own_embedder.use_runner(runner)
    engine.shutdown()
    vectors = own_embedder.embed(TEXTS)
    assert vectors.shape == (3, own_embedder.dimension)
    assert own_embedder._runner is None and engine.jobs_run == 0


def test_pipelines_route_the_model_through_their_runner_and_release_it_on_close(
    engine, tokenizer, own_embedder
):
    from ctxgate.compression.pipeline import CompressionPipeline
    from ctxgate.compression.store.cache import LRUBytesCache

    pipeline = CompressionPipeline(
        tokenizer, cache=LRUBytesCache(), embed_runner=engine.run_between_steps, embed_process=True
    )
    import ctxgate.compression.embedding.embeddings as embeddings

    key = (str(own_embedder.model_path), 0)
    previous = embeddings._shared.get(key)
    embeddings._shared[key] = own_embedder
    try:
        assert pipeline.services.embedder is own_embedder
        assert own_embedder._process is None  # the runner, not a child process
        own_embedder.embed(["A sentence no one embedded before."])
        assert engine.jobs_run == 1
        pipeline.close()
        assert own_embedder._runner is None
    finally:
        if previous is None:
            embeddings._shared.pop(key, None)
        else:
            embeddings._shared[key] = previous


def test_only_the_forward_pass_runs_on_the_engine_thread(engine, own_embedder):
    packed = own_embedder._packed
    pack, forward = packed.pack, packed.encode_packed
    threads: dict[str, str] = {}

    def recorded(name, call):
        def run(argument):
            threads[name] = threading.current_thread().name
            return call(argument)

        return run

    packed.pack, packed.encode_packed = recorded("pack", pack), recorded("forward", forward)
    own_embedder.use_runner(engine.run_between_steps)
    assert own_embedder._encode_now(TEXTS).shape == (3, own_embedder.dimension)
    assert threads["pack"] == threading.current_thread().name, "the tokenizer runs on the caller's thread"
    assert threads["forward"] != threads["pack"] and engine.jobs_run == 1


def test_warm_up_runs_each_shape_as_an_engine_job(engine, own_embedder, monkeypatch):
    import ctxgate.compression.embedding.packed_encoder as packed_encoder

    monkeypatch.setattr(packed_encoder, "WARM_UP_ROWS", 3 * own_embedder._packed.chunk_tokens)
    own_embedder._packed.builds_per_shape = True  # as on the oneDNN bf16 path, whatever this CPU has
    own_embedder.use_runner(engine.run_between_steps)
    # Three chunk counts, plus a small call's narrow chunk where the usual chunk is wider.
    shapes = 3 + (own_embedder._packed.chunk_tokens > packed_encoder.SMALL_CALL_TOKENS)
    assert own_embedder.warm_up() == shapes and engine.jobs_run == shapes
    stop = threading.Event()
    stop.set()
    assert own_embedder.warm_up(stop) == 0 and engine.jobs_run == shapes, "a server shutting down ends it"
    engine.shutdown()
    assert own_embedder.warm_up() == shapes, "an engine that is gone leaves the warm-up in process"
    assert own_embedder._runner is None


def test_calls_that_wait_for_the_engine_together_share_one_forward_pass(engine, own_embedder):
    """A burst of cold requests: their calls queue while the engine's thread is busy, then run as
    one pass on it, each caller with the vectors it would have got alone."""

    alone = {text: own_embedder._encode_now([text])[0] for text in TEXTS}
    own_embedder.use_runner(engine.run_between_steps)
    release = threading.Event()
    engine.run_between_steps(lambda: release.wait(30))  # the engine thread is busy until released
    results: dict[str, np.ndarray] = {}
    engine_seconds: dict[str, float] = {}

    def call(text: str) -> None:
        from ctxgate.compression.embedding.batching import ENGINE_TIME, EngineTime

        charged = EngineTime()
        ENGINE_TIME.set(charged)  # as CompressionPipeline.run_here does for each compression
        results[text] = own_embedder._encode_now([text])
        engine_seconds[text] = charged.seconds

    threads = [threading.Thread(target=call, args=(text,)) for text in TEXTS]
    for thread in threads:
        thread.start()
    eventually(
        lambda: len(own_embedder._engine_jobs._pending) >= len(TEXTS),
        timeout_s=30,
        interval_s=0.005,
        message="the calls never queued",
    )
    release.set()
    for thread in threads:
        thread.join(timeout=30)
    jobs = own_embedder._engine_jobs
    assert (jobs.batches, jobs.calls) == (1, len(TEXTS))
    assert engine.jobs_run == 1 + len(TEXTS)  # the blocker, and one job per call (two found theirs taken)
    # int8's activation scales are per call, over every row in it: a shared pass moves them.
    minimum = 0.95 if own_embedder.precision == "int8" else 0.9999
    for text in TEXTS:
        assert results[text].shape == (1, own_embedder.dimension)
        assert float(results[text][0] @ alone[text]) > minimum
    # Each caller is charged its share of the shared pass's time on the engine, by word pieces.
    word_pieces = {text: len(own_embedder._packed.pack([text]).input_ids) for text in TEXTS}
    assert all(seconds > 0 for seconds in engine_seconds.values())
    first, second = TEXTS[0], TEXTS[1]
    assert engine_seconds[first] / engine_seconds[second] == pytest.approx(
        word_pieces[first] / word_pieces[second]
    )


def test_a_compression_reports_the_time_its_embedding_held_the_engine(engine, tokenizer, own_embedder):
    """CompressionResult.engine_ms: the engine thread's time on this compression's embedding passes,
    none when every vector came from the cache, none when the model runs in process."""
    import asyncio

    from ctxgate.compression.pipeline import CompressionPipeline
    from ctxgate.compression.types import CompressionInput, Document
    from ctxgate.policies.loader import load_policy_file, packaged_policy_dir

    policy = load_policy_file(packaged_policy_dir() / "rag-default.yaml")
    documents = [
        Document(text=f"{text} It was noted in {year}.", id=f"d{year}", title=f"Note {year}")
        for year, text in zip((1901, 1902, 1903), TEXTS, strict=True)
    ]
    request = CompressionInput(
        messages=[{"role": "user", "content": "Who is the mayor of Arlen?"}], documents=documents
    )
    import ctxgate.compression.embedding.embeddings as embeddings

    key = (str(own_embedder.model_path), 0)
    previous = embeddings._shared.get(key)
    embeddings._shared[key] = own_embedder
    try:
        in_process = CompressionPipeline(tokenizer)
        assert asyncio.run(in_process.run_here(request, policy)).engine_ms == 0.0
        in_process.close()
        own_embedder._local.clear()
        # As the gateway builds it: the model on the engine's thread, and a batching window, which
        # such calls skip (they coalesce on the engine instead) so the time is charged to them.
        on_engine = CompressionPipeline(
            tokenizer, embed_runner=engine.run_between_steps, embed_batch_window_ms=3.0
        )
        cold = asyncio.run(on_engine.run_here(request, policy))
        assert engine.jobs_run >= 1 and cold.engine_ms > 0
        assert cold.engine_ms <= sum(cold.compression_ms.values())  # a part of the compression's own time
        assert own_embedder._batcher is not None and own_embedder._batcher.calls == 0
        warm = asyncio.run(on_engine.run_here(request, policy))
        assert warm.engine_ms == 0.0  # every vector cached: the engine was not asked
        on_engine.close()
    finally:
        if previous is None:
            embeddings._shared.pop(key, None)
        else:
            embeddings._shared[key] = previous
