"""Fixtures for the eval's end-to-end tests: one real engine per session, shared by the gateways
the tests start (loading the model once keeps the suite fast on two cores)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def eval_engine(model_dir):
    """The in-process engine, shared by every gateway these tests start."""
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig

    engine = AsyncEngine(EngineConfig(model=str(model_dir)))
    yield engine
    engine.shutdown()


# A small budget, so a 6-passage question is really cut (with or without compression stages), and
# request overrides for the sweep against a running gateway.
TIGHT_POLICY = """\
name: eval-tight
description: eval tests - a small prompt budget
max_input_tokens: 400
reserve_output_tokens: 64
documents: {max_tokens: 240}
rerank: {method: embedding-bm25, top_k: 3}
assembly: {order: best-first, placement: user}
allow_request_overrides: [documents.max_tokens, max_input_tokens]
"""


@pytest.fixture(scope="session")
def eval_policy_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("eval-policies")
    (directory / "eval-tight.yaml").write_text(TIGHT_POLICY)
    return directory
