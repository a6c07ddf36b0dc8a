"""A real gateway (real engine, rag-default policy) on a free port for the framework integrations."""

from __future__ import annotations

import pytest

from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.conftest import engine  # noqa: F401 (the session's real engine)
from tests.support.servers import ServerThread
from tests.town_facts import TOWN_FACTS, TOWN_QUESTION

MODEL = "SmolLM2-135M-Instruct"
FACTS = TOWN_FACTS
QUESTION = TOWN_QUESTION


@pytest.fixture(scope="module")
def gateway_url(engine):  # noqa: F811
    # Small budgets so eight short passages are over them and are cut.
    settings = GatewaySettings(default_policy="rag-default")
    with ServerThread(create_app(settings, engine=engine)) as running:
        yield f"{running.url}/v1"


OVERRIDES = {"documents.max_tokens": 60, "rerank.top_k": 2}
