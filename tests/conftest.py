"""Shared fixtures: the default model directory (converted once per machine) and its tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dir():
    from ctxgate.backend.model.model_prepare import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from ctxgate.backend.model.tokenizer import load_tokenizer

    return load_tokenizer(str(model_dir))


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free port, in this test's temporary folder."""
    from tests.support.redis import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    """The Qwen2.5-Coder-0.5B Q4_K_M GGUF (`make large-model`); under CI=true its absence fails."""
    from tests.support import large_model

    path = large_model.find()
    if path is None:
        message = f"{large_model.FILENAME} not found: run `make large-model` or set ${large_model.PATH_ENV}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def qwen_dir(qwen_gguf) -> Path:
    from ctxgate.backend.model.model_prepare import prepare_gguf

    return prepare_gguf(qwen_gguf)
