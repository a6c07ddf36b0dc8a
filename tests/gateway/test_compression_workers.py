"""Compression's thread budget (`serve --compression-workers`, `server.compression_workers`): one
worker per two cores unless set, set from the flag or the config file, refused below one; and the
workers' CPU priority below the engine's (`--compression-nice`, `server.compression_nice`)."""

from __future__ import annotations

import sys

import pytest
import yaml

from ctxgate.cli import parse_args
from ctxgate.gateway.cli import resolve_serve_args
from ctxgate.gateway.settings import GatewaySettings, default_compression_workers


def _serve_args(argv: list[str]) -> GatewaySettings:
    return resolve_serve_args(parse_args(["serve", *argv])).settings


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (2, 1), (3, 1), (8, 4), (None, 1)])
def test_the_default_is_one_worker_per_two_cores(monkeypatch, cores, workers):
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert default_compression_workers() == workers
    assert GatewaySettings().compression_workers == workers


def test_fewer_than_one_worker_is_refused():
    with pytest.raises(ValueError, match="compression_workers must be at least 1, not 0"):
        GatewaySettings(compression_workers=0)


def test_the_flag_and_the_config_file_set_it(tmp_path, capsys):
    assert (
        _serve_args([]).compression_workers == default_compression_workers()
    )  # unset: the settings' default
    assert _serve_args(["--compression-workers", "3"]).compression_workers == 3
    path = tmp_path / "ctxgate.yaml"
    path.write_text(yaml.safe_dump({"server": {"compression_workers": 2}}))
    assert _serve_args(["--config", str(path)]).compression_workers == 2
    assert _serve_args(["--config", str(path), "--compression-workers", "4"]).compression_workers == 4
    for bad, message in (("0", "must be at least 1, not 0"), ("two", "invalid int value: 'two'")):
        with pytest.raises(SystemExit):
            parse_args(["serve", "--compression-workers", bad])
        assert message in capsys.readouterr().err


def test_bench_e2e_refuses_zero_workers_before_starting_anything(capsys):
    with pytest.raises(SystemExit):
        parse_args(["bench", "e2e", "--compression-workers", "0"])
    assert "must be at least 1, not 0" in capsys.readouterr().err


def test_the_config_file_refuses_zero_workers(tmp_path):
    from ctxgate.gateway.config_file import ConfigError, load_config

    path = tmp_path / "ctxgate.yaml"
    path.write_text("server:\n  compression_workers: 0\n")
    with pytest.raises(ConfigError, match="compression_workers"):
        load_config(path, environ={})


def test_the_pipeline_compresses_in_that_many_threads(tokenizer):
    from ctxgate.gateway.app import default_pipeline

    # No engine: the embedder runs in its own process (embed_on "engine" needs one).
    settings = GatewaySettings(compression_workers=3, embed_cache_url=None, embed_on="process")
    pipeline = default_pipeline(tokenizer, None, settings=settings)
    try:
        assert pipeline._executor is not None and pipeline._executor.slots == 3
    finally:
        pipeline.close()


def test_the_cache_budget_setting_sizes_the_compressors_caches(tokenizer):
    from ctxgate.compression.store.cache import (
        DEFAULT_CACHE_BYTES,
        budget_bytes,
        cache_budget,
        set_cache_budget,
    )
    from ctxgate.gateway.app import default_pipeline

    assert GatewaySettings().compression_cache_mb * 1024 * 1024 == DEFAULT_CACHE_BYTES
    settings = GatewaySettings(compression_cache_mb=32, embed_cache_url=None, embed_on="process")
    pipeline = default_pipeline(tokenizer, None, settings=settings)
    try:
        assert cache_budget() == 32 * 1024 * 1024
        assert pipeline.counter._counts.max_bytes == budget_bytes("token_counts") < 4 * 1024 * 1024
        assert pipeline.cache.max_bytes == budget_bytes("summaries")
    finally:
        pipeline.close()
        set_cache_budget(DEFAULT_CACHE_BYTES)


def test_the_workers_run_at_the_engines_cpu_priority_by_default_and_refuse_a_bad_nice():
    from ctxgate.gateway.settings import DEFAULT_COMPRESSION_NICE

    assert GatewaySettings().compression_nice == DEFAULT_COMPRESSION_NICE == 0
    for bad in (-1, 20):
        with pytest.raises(ValueError, match=f"compression_nice must be from 0 to 19, not {bad}"):
            GatewaySettings(compression_nice=bad)


def test_the_nice_flag_and_config_key_set_it(tmp_path, capsys):
    assert _serve_args([]).compression_nice == 0  # unset: the settings' default applies
    assert _serve_args(["--compression-nice", "0"]).compression_nice == 0
    path = tmp_path / "ctxgate.yaml"
    path.write_text(yaml.safe_dump({"server": {"compression_nice": 5}}))
    assert _serve_args(["--config", str(path)]).compression_nice == 5
    assert _serve_args(["--config", str(path), "--compression-nice", "19"]).compression_nice == 19
    for command, not_a_number in (
        (["serve"], "invalid int value: 'low'"),
        (["bench", "e2e"], "expected a whole number, not 'low'"),
    ):
        for bad, message in (("20", "must be from 0 to 19, not 20"), ("low", not_a_number)):
            with pytest.raises(SystemExit):
                parse_args([*command, "--compression-nice", bad])
            assert message in capsys.readouterr().err


def test_the_config_file_refuses_a_nice_beyond_19(tmp_path):
    from ctxgate.gateway.config_file import ConfigError, load_config

    path = tmp_path / "ctxgate.yaml"
    path.write_text("server:\n  compression_nice: 25\n")
    with pytest.raises(ConfigError, match="compression_nice"):
        load_config(path, environ={})


def _own_priority() -> int:
    import os
    import threading

    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
@pytest.mark.parametrize("nice", [0, 7, 19])
def test_a_worker_thread_runs_that_much_lower_and_the_caller_keeps_its_priority(tokenizer, nice):
    from ctxgate.gateway.app import default_pipeline

    caller = _own_priority()
    settings = GatewaySettings(
        compression_workers=1, compression_nice=nice, embed_cache_url=None, embed_on="process"
    )
    pipeline = default_pipeline(tokenizer, None, settings=settings)
    try:
        assert pipeline._executor.submit("tenant", _own_priority).result(timeout=30) == min(19, caller + nice)
    finally:
        pipeline.close()
    assert _own_priority() == caller  # the thread's, not the process's
