"""`ctxgate serve --config`: os.environ/NAME interpolation, validation messages, and flag > file > default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from ctxgate.backend.engine.config import EngineConfig
from ctxgate.cli import build_parser, parse_args
from ctxgate.gateway.cli import resolve_serve_args
from ctxgate.gateway.config_file import (
    DEPRECATED_KEYS,
    ConfigError,
    interpolate,
    key_flags,
    load_config,
)
from ctxgate.gateway.keys import hash_key
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import free_port, wait_http

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def _serve_args(argv: list[str]):
    return resolve_serve_args(parse_args(["serve", *argv]))


def test_interpolation_replaces_references_anywhere_and_names_missing_variables(tmp_path):
    env = {"REDIS_URL": "redis://cache:6379/0", "UP1": "http://a:8001", "PORT": "9100"}
    data = {
        "server": {
            "redis_url": "os.environ/REDIS_URL",
            "upstreams": ["os.environ/UP1", "http://b"],
            "port": "os.environ/PORT",
            "host": "os.environ.not-a-reference",
        }
    }
    assert interpolate(data, env) == {
        "server": {
            "redis_url": "redis://cache:6379/0",
            "upstreams": ["http://a:8001", "http://b"],
            "port": "9100",
            "host": "os.environ.not-a-reference",
        }
    }
    config = load_config(_write(tmp_path / "c.yaml", data), environ=env)
    assert config.server.port == 9100 and config.server.redis_url == "redis://cache:6379/0"

    with pytest.raises(ConfigError) as missing:
        load_config(_write(tmp_path / "c.yaml", data), environ={"UP1": "x", "PORT": "1"})
    assert str(missing.value) == (
        f"{tmp_path / 'c.yaml'}: field 'server.redis_url': environment variable REDIS_URL is not set"
    )
    with pytest.raises(ConfigError, match=r"field 'server.upstreams.0': 'os.environ/1BAD' is not a valid"):
        interpolate({"server": {"upstreams": ["os.environ/1BAD"]}}, {})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"server": {"prot": 1}},
            "field 'server.prot': Extra inputs are not permitted; did you mean 'port'?",
        ),
        ({"server": {"port": 0}}, "field 'server.port': Input should be greater than or equal to 1"),
        ({"engine": {"dtype": "fp8"}}, "field 'engine.dtype': Input should be 'auto', 'float32'"),
        ({"server": {"upstreams": "http://one"}}, "field 'server.upstreams': Input should be a valid list"),
        (
            {"server": {"compression_workers": 0}},
            "field 'server.compression_workers': compression_workers must be at",
        ),
        (
            {"server": {"model": "/m"}},
            "field 'server.model': Extra inputs are not permitted",
        ),  # it is engine.model
        (["server"], "the top level must be a mapping of sections"),
        (
            {"engine": {"num_kv_blocks": 8, "kv_cache_memory_mb": 64}},
            "field 'engine': set num_kv_blocks or kv_cache_memory_mb, not both",
        ),
        (
            {"engine": {"weight_quant": "int4", "dtype": "float16"}},
            "field 'engine': weight_quant int4 runs with bfloat16",
        ),
        (
            {"engine": {"threads": 2, "num_threads": 4}},
            "field 'engine.threads': the deprecated name of 'engine.num_threads'",
        ),
    ],
)
def test_validation_names_file_field_and_reason(tmp_path, data, message):
    path = _write(tmp_path / "bad.yaml", data)
    with pytest.raises(ConfigError) as error:
        load_config(path, environ={})
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


def test_every_problem_of_a_file_is_reported_at_once(tmp_path):
    path = _write(
        tmp_path / "bad.yaml",
        {
            "server": {"prot": 1, "port": 0, "redis_url": "os.environ/CG_UNSET_1"},
            "engine": {"dtype": "fp8", "max_num_seqs": -1, "threads": 0},
            "upstreams": {"retries": -1},
            "colour": "blue",
        },
    )
    with pytest.raises(ConfigError) as error:
        load_config(path, environ={})
    assert (
        error.value.problems
        == [
            "field 'server.redis_url': environment variable CG_UNSET_1 is not set",
            "field 'server.port': Input should be greater than or equal to 1",
            "field 'server.upstream_retries': Input should be greater than or equal to 0",  # written upstreams.retries
            "field 'server.prot': Extra inputs are not permitted; did you mean 'port'?",
            "field 'engine.dtype': Input should be 'auto', 'float32', 'bfloat16' or 'float16'",
            "field 'engine.max_num_seqs': Input should be greater than or equal to 1",
            "field 'engine.num_threads': Input should be greater than or equal to 1",
            "field 'colour': Extra inputs are not permitted",
        ]
    )
    assert str(error.value).splitlines() == [f"{path}: {problem}" for problem in error.value.problems]


def test_every_config_key_is_a_settings_field_and_a_serve_flag():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    options = {option for action in serve._actions for option in action.option_strings}
    keys = key_flags()
    # One name per setting: the key is the field's name and the flag is that name with dashes.
    assert {key for key in keys if key.startswith("server.")} == {
        f"server.{name}" for name in GatewaySettings.model_fields if name not in ("model", "model_list")
    }
    assert {key for key in keys if key.startswith("engine.")} == {
        f"engine.{name}" for name in EngineConfig.model_fields
    }
    assert set(keys.values()) <= options
    assert keys["server.max_in_flight"] == "--max-in-flight" and keys["engine.num_threads"] == "--num-threads"
    # Every old key moves to a current one.
    assert set(DEPRECATED_KEYS.values()) <= set(keys)


def test_old_keys_still_load_with_a_warning(tmp_path):
    path = _write(
        tmp_path / "old.yaml",
        {
            "server": {"reload_interval": 2.5, "drain_timeout": 7},
            "engine": {
                "threads": 3,
                "prefix_caching": False,
                "max_waiting_requests": 9,
                "embed_on": "process",
            },
            "upstreams": {
                "urls": ["http://u:1"],
                "model": "m",
                "connect_timeout": 0.5,
                "read_timeout": 9,
                "retries": 0,
                "api_key": "k",
            },
            "redis": {"url": "redis://r"},
            "keys_file": "keys.yaml",
            "policy_dir": "/p",
            "logging": {"level": "DEBUG", "access_log": True},
            "metrics": {"key": "m-key", "vllm_names": True},
        },
    )
    warnings: list[str] = []
    config = load_config(path, environ={}, warn=warnings.append)
    assert (
        len(warnings) == 18
        and f"{path}: 'engine.threads' is deprecated; use 'engine.num_threads'" in warnings
    )
    server, engine = config.server, config.engine
    assert (server.reload_interval_s, server.drain_timeout_s, server.engine_max_waiting_requests) == (
        2.5,
        7,
        9,
    )
    assert (engine.num_threads, engine.enable_prefix_caching, server.embed_on) == (3, False, "process")
    assert (
        server.upstreams,
        server.upstream_model,
        server.upstream_connect_timeout_s,
        server.upstream_read_timeout_s,
        server.upstream_retries,
        server.upstream_api_key,
    ) == (["http://u:1"], "m", 0.5, 9, 0, "k")
    assert (server.redis_url, server.keys_file, str(server.policy_dir)) == (
        "redis://r",
        tmp_path / "keys.yaml",
        "/p",
    )
    assert (config.logging.level, server.access_log, server.metrics_key, server.vllm_metric_names) == (
        "DEBUG",
        True,
        "m-key",
        True,
    )


def test_flags_given_override_the_file_which_overrides_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("CG_TEST_PORT", "9123")
    monkeypatch.setenv("REDIS_URL", "redis://from-env")
    path = _write(
        tmp_path / "ctxgate.yaml",
        {
            "server": {
                "port": "os.environ/CG_TEST_PORT",
                "max_in_flight": 3,
                "max_queued": 5,
                "request_timeout_s": 0,
                "upstreams": ["http://file-upstream:8001"],
                "upstream_retries": 4,
                "keys_file": "keys.yaml",
                "policy_dir": "/etc/ctxgate/policies",
                "redis_url": "redis://from-file",
                "tokenizer": None,
            },
            "engine": {"enable_prefix_caching": False, "max_model_len": 512},
            "logging": {"level": "WARNING"},
        },
    )
    resolved = _serve_args(["--config", str(path), "--max-queued", "64", "--upstreams", "http://flag:1"])
    settings, engine = resolved.settings, resolved.engine
    assert settings.port == 9123 and settings.max_in_flight == 3  # from the file
    assert settings.request_timeout_s is None  # 0: no limit
    assert settings.max_queued == 64  # given explicitly, although it equals the default
    assert settings.upstreams == ["http://flag:1"] and settings.upstream_retries == 4
    assert engine.enable_prefix_caching is False and engine.max_model_len == 512
    assert settings.keys_file == tmp_path / "keys.yaml"  # relative to the config file
    assert str(settings.policy_dir) == "/etc/ctxgate/policies"
    assert settings.redis_url == "redis://from-file"  # the file beats the environment variable
    assert settings.host == "127.0.0.1" and settings.queue_timeout_s == 10.0  # untouched defaults
    assert settings.tokenizer is None  # null: the default
    assert resolved.log_level == "WARNING"

    assert _serve_args(["--config", str(path), "--log-level", "debug"]).log_level == "DEBUG"
    assert (
        _serve_args(["--config", str(path), "--redis-url", "redis://flag"]).settings.redis_url
        == "redis://flag"
    )
    bare = _serve_args([])
    assert (
        bare.settings.port == 8000 and bare.settings.redis_url == "redis://from-env"
    )  # no file: env, defaults
    assert bare.engine == EngineConfig()

    sized = _write(tmp_path / "sized.yaml", {"engine": {"kv_cache_memory_mb": 256}})
    flag = _serve_args(["--config", str(sized), "--num-kv-blocks", "64"]).engine
    assert flag.num_kv_blocks == 64 and flag.kv_cache_memory_mb is None  # the flag replaces the file's choice
    assert _serve_args(["--config", str(sized)]).engine.kv_cache_memory_mb == 256
    assert _serve_args(["--model", "/models/m"]).settings.model == "/models/m"  # one --model for both


def test_a_combination_the_models_refuse_names_the_section():
    with pytest.raises(ValueError, match="^engine: weight_quant int4 runs with bfloat16"):
        _serve_args(["--weight-quant", "int4", "--dtype", "float32"])


def test_config_cli_check_and_schema(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CG_UNSET", None)
    good = _write(tmp_path / "good.yaml", {"server": {"port": 8100}})
    bad = _write(tmp_path / "bad.yaml", {"server": {"redis_url": "os.environ/CG_UNSET", "port": "eighty"}})
    result = subprocess.run(
        [sys.executable, "-m", "ctxgate", "config", "check", str(good), str(bad)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )
    assert result.returncode == 1
    assert f"{good}: ok" in result.stdout
    assert result.stderr.strip().splitlines() == [  # every problem, not only the first
        f"{bad}: field 'server.redis_url': environment variable CG_UNSET is not set",
        f"{bad}: field 'server.port': Input should be a valid integer, unable to parse string as an integer",
    ]
    refs = _write(
        tmp_path / "refs.yaml",
        {
            "server": {"keys_file": "nope.yaml", "policy_dir": "nowhere"},
            "engine": {"model": str(tmp_path / "absent.gguf")},
        },
    )
    result = subprocess.run(
        [sys.executable, "-m", "ctxgate", "config", "check", str(refs)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )
    keys = tmp_path / "nope.yaml"
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"{refs}: field 'server.keys_file' (--keys-file): keys file not found: {keys} "
        f"(create it with `ctxgate keys add TENANT --keys-file {keys}`)",
        f"{refs}: field 'server.policy_dir' (--policy-dir): policy folder not found: {tmp_path / 'nowhere'}",
        f"{refs}: field 'engine.model' (--model): GGUF file not found: {tmp_path / 'absent.gguf'}",
    ]
    serve = subprocess.run(
        [sys.executable, "-m", "ctxgate", "serve", "--config", str(bad)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )
    assert serve.returncode == 2 and "Traceback" not in serve.stderr
    assert "environment variable CG_UNSET is not set" in serve.stderr
    schema = subprocess.run(
        [sys.executable, "-m", "ctxgate", "config", "schema"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )
    parsed = json.loads(schema.stdout)
    assert set(parsed["properties"]) == {"server", "engine", "logging", "model_list"}


def test_serve_runs_from_the_config_file_alone(tmp_path):
    """The port, keys file and upstream come from the file (port via os.environ/), nothing from flags."""
    port = free_port()
    (tmp_path / "keys.yaml").write_text(
        yaml.safe_dump({"tenants": {"acme": {"keys": [{"sha256": hash_key("cg-config-key")}]}}})
    )
    path = _write(
        tmp_path / "ctxgate.yaml",
        {
            "server": {
                "port": "os.environ/CG_PORT",
                "served_model_name": "from-config",
                "keys_file": "keys.yaml",
                "upstreams": [f"http://127.0.0.1:{free_port()}"],
                "upstream_model": "from-config",
            },
        },
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "CG_PORT": str(port)}
    env.pop("REDIS_URL", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "ctxgate", "serve", "--config", str(path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", timeout_s=60)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        models = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer cg-config-key"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "from-config"
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_an_unknown_key_names_the_close_match(tmp_path):
    path = _write(
        tmp_path / "typo.yaml",
        {
            "server": {"acces_log": False},
            "engine": {"max_num_seq": 3},
            "model_list": [
                {"model_name": "m", "deployments": [{"engine": "builtin"}], "tokeniser": "cl100k_base"}
            ],
            "loging": {"level": "INFO"},
        },
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    problems = caught.value.problems
    assert "field 'server.acces_log': Extra inputs are not permitted; did you mean 'access_log'?" in problems
    assert (
        "field 'engine.max_num_seq': Extra inputs are not permitted; did you mean 'max_num_seqs'?" in problems
    )
    assert (
        "field 'model_list.0.tokeniser': Extra inputs are not permitted; did you mean 'tokenizer'?"
        in problems
    )
    assert "field 'loging': Extra inputs are not permitted; did you mean 'logging'?" in problems
