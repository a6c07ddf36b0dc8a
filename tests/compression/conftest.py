"""Compression fixtures: the real backend tokenizer and one shared embedding model per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def embedder():
    from compression.embeddings import shared_embedder

    return shared_embedder()


@pytest.fixture
def make_pipeline(tokenizer, embedder):
    """Pipelines share the session's embedding model (loading it takes seconds on 2 cores)."""
    from compression.cache import LRUBytesCache
    from compression.pipeline import CompressionPipeline

    def factory(**kwargs):
        kwargs.setdefault("cache", LRUBytesCache())
        pipeline = CompressionPipeline(tokenizer, **kwargs)
        pipeline.services._embedder = embedder
        return pipeline

    return factory
