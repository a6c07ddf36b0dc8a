"""Where the gateway's embedding model runs (`serve --embed-on`, `engine.embed_on`): the wiring
from settings to the pipeline, and a clear error for a value that is neither."""

from __future__ import annotations

import pytest

from ctxgate.gateway.app import default_pipeline
from ctxgate.gateway.settings import GatewaySettings


@pytest.fixture(scope="module")
def engine(model_dir):
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig

    async_engine = AsyncEngine(
        EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=16, max_model_len=128)
    )
    yield async_engine
    async_engine.shutdown()


def test_on_a_cpu_engine_the_model_runs_as_engine_jobs_by_default(engine, tokenizer):
    services = default_pipeline(tokenizer, engine, settings=GatewaySettings()).services
    assert services.embed_runner == engine.run_between_steps
    assert services.embed_process is False


def test_embed_on_process_keeps_the_child_process(engine, tokenizer):
    services = default_pipeline(tokenizer, engine, settings=GatewaySettings(embed_on="process")).services
    assert services.embed_runner is None and services.embed_process is True


def test_an_engine_without_jobs_gets_the_child_process(tokenizer):
    from ctxgate.backend.routing.upstream import UpstreamClient, UpstreamConfig

    upstream = UpstreamClient(UpstreamConfig(urls=["http://127.0.0.1:9"]))
    services = default_pipeline(tokenizer, upstream, settings=GatewaySettings()).services
    assert services.embed_runner is None and services.embed_process is True


def test_an_unknown_place_is_refused_with_its_name():
    with pytest.raises(ValueError, match=r"embed_on\n  Input should be 'engine' or 'process'"):
        GatewaySettings(embed_on="gpu")


def test_the_config_file_refuses_an_unknown_place(tmp_path):
    from ctxgate.gateway.config_file import ConfigError, load_config

    path = tmp_path / "ctxgate.yaml"
    path.write_text("engine:\n  embed_on: gpu\n")
    with pytest.raises(ConfigError, match="embed_on"):
        load_config(path, environ={})
