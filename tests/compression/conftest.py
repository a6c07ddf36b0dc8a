"""Compression fixtures: the real backend tokenizer and one shared embedding model per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def embedder():
    from ctxgate.compression.embedding.embeddings import shared_embedder

    return shared_embedder()


@pytest.fixture
def make_pipeline(tokenizer, embedder):
    """Pipelines share the session's embedding model (loading it takes seconds on 2 cores)."""
    from ctxgate.compression.pipeline import CompressionPipeline
    from ctxgate.compression.store.cache import LRUBytesCache

    def factory(**kwargs):
        kwargs.setdefault("cache", LRUBytesCache())
        pipeline = CompressionPipeline(tokenizer, **kwargs)
        pipeline.services._embedder = embedder
        return pipeline

    return factory
