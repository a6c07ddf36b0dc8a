"""/ready waits for the compression embedder: while the embedding model (here in its own child
process) is loading, a real server answers 503 naming it, and 200 only once it is loaded."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import ServerThread
from tests.support.waiting import eventually


@pytest.fixture
def unloaded_embedding_model(tmp_path, monkeypatch):
    """The embedding model under a path this test process has not loaded: the process keeps one model
    per path (`shared_embedder`), so the server's load is a real one whatever tests ran before."""
    from ctxgate.compression.embedding.embeddings import EMBED_MODEL_ENV, default_model_path, shared_embedder

    link = tmp_path / "embedding-model"
    link.symlink_to(default_model_path(), target_is_directory=True)
    monkeypatch.setenv(EMBED_MODEL_ENV, str(link))
    yield
    shared_embedder().close_process()  # the child process this test's server started


def test_ready_answers_503_until_the_embedder_is_loaded(engine, unloaded_embedding_model, caplog):
    caplog.set_level(logging.INFO, logger="ctxgate.gateway.lifecycle")
    answers: list[tuple[int, dict]] = []
    first_ready_at: list[float] = []

    def ready() -> bool:
        response = httpx.get(f"{server.url}/ready", timeout=10)
        answers.append((response.status_code, response.json()))
        if response.status_code == 200:
            first_ready_at.append(time.time())
        return response.status_code == 200

    with ServerThread(create_app(GatewaySettings(embed_on="process"), engine=engine)) as server:
        eventually(ready, timeout_s=300, interval_s=0.05, message=lambda: f"/ready answered {answers[-1:]}")
        loaded_logs = [r for r in caplog.records if r.getMessage().startswith("embedding model loaded")]

    loading = [body for status, body in answers if status == 503]
    assert loading, "the server was ready before its embedding model could have loaded"
    assert all(
        body == {**body, "status": "not ready", "engine": True, "store": True, "embedder": False}
        for body in loading
    ), loading
    assert answers[-1][1]["embedder"] is True and answers[-1][1]["status"] == "ready"
    # The load had finished (model in this process, its child process started, warmed up) when the
    # first 200 went out.
    assert len(loaded_logs) == 1 and loaded_logs[0].created <= first_ready_at[0]
