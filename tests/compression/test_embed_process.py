"""The embedding model in a child process: the same vectors as in process, a child that dies is
started again, and closing the pipe ends the child."""

from __future__ import annotations

import numpy as np
import pytest

from ctxgate.compression.embedding.embed_process import EmbedProcess, EmbedProcessError

TEXTS = ["The river Vey runs north.", "Ida Holm is the mayor of Arlen.", "Photosynthesis needs light."]


@pytest.fixture(scope="module")
def process(embedder):
    child = EmbedProcess(embedder.model_path, embedder.precision, threads=1)
    yield child
    child.close()


def test_the_child_gives_the_in_process_vectors(process, embedder):
    from_child = process.encode(TEXTS)
    in_process = embedder._encode_now(TEXTS)
    assert from_child.shape == (3, embedder.dimension) and from_child.dtype == np.float32
    assert (from_child * in_process).sum(axis=1).min() > 0.999


def test_a_child_that_died_is_started_again(process):
    before = process.starts
    process._process.kill()
    process._process.wait()
    assert process.encode(TEXTS[:1]).shape == (1, process.dimension)
    assert process.starts == before + 1


def test_a_call_to_a_child_dying_unseen_is_answered_by_its_successor(process):
    # Killed but not reaped: the parent may still see it running, write, and read EOF; either way
    # the call is answered by a new child rather than failing.
    before = process.starts
    process._process.kill()
    assert process.encode(TEXTS).shape == (3, process.dimension)
    assert process.starts == before + 1


def test_closing_ends_the_child(embedder):
    child = EmbedProcess(embedder.model_path, embedder.precision, threads=1)
    popen = child._process
    child.close()
    assert popen.wait(10) == 0


def test_a_child_that_cannot_load_the_model_says_why(tmp_path):
    with pytest.raises(EmbedProcessError, match="failed to start"):
        EmbedProcess(tmp_path / "no-model-here", "float32")


def test_an_embedder_with_a_process_routes_its_model_calls_there(embedder):
    from ctxgate.compression.embedding.embeddings import Embedder

    own = Embedder(embedder.model_path, precision=embedder.precision)
    child = own.use_process(threads=1)
    try:
        assert own.use_process() is child  # idempotent
        vectors = own.embed(TEXTS)
        assert own.encoded_texts == 3
        assert (vectors * embedder.embed(TEXTS)).sum(axis=1).min() > 0.999
    finally:
        own.close_process()
    assert child._process is None
