"""A real gateway (real engine, rag-default policy) on a free port for the framework integrations."""

from __future__ import annotations

import pytest

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.gateway.conftest import ServerThread, engine  # noqa: F401 (the session's real engine)

MODEL = "SmolLM2-135M-Instruct"
FACTS = [
    ("Arlen", "Town Arlen has a population of 1200. It lies on the river Vey. Its mayor is Ida Holm."),
    ("Brisk", "Town Brisk has a population of 5400. It lies on the river Orn. Its mayor is Tomas Veld."),
    ("Cirra", "Town Cirra has a population of 870. It lies on the river Lune. Its mayor is Mara Quist."),
    ("Dovel", "Town Dovel has a population of 23000. It lies on the river Sarn. Its mayor is Pell Ochs."),
    ("Esker", "Town Esker has a population of 310. It lies on the river Tay. Its mayor is Una Brack."),
    ("Fallow", "Town Fallow has a population of 4100. It lies on the river Wend. Its mayor is Rolf Jansk."),
    ("Gorse", "Town Gorse has a population of 650. It lies on the river Yen. Its mayor is Lia Dorn."),
    ("Hollin", "Town Hollin has a population of 9900. It lies on the river Ash. Its mayor is Bran Olk."),
]
QUESTION = "Who is the mayor of Cirra?"


@pytest.fixture(scope="module")
def gateway_url(engine):  # noqa: F811
    # Small budgets so eight short passages are over them and are cut.
    settings = GatewaySettings(default_policy="rag-default")
    with ServerThread(create_app(settings, engine=engine)) as running:
        yield f"{running.url}/v1"


OVERRIDES = {"documents.max_tokens": 60, "rerank.top_k": 2}
