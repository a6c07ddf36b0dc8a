"""Shared fixtures: the default model directory (converted once per machine) and its tokenizer."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dir():
    from backend.model_prepare import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from backend.tokenizer import load_tokenizer

    return load_tokenizer(str(model_dir))


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free port, in this test's temporary folder."""
    from tests.support.redis import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
