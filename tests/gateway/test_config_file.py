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

from ctxgate.cli import build_parser, parse_args
from gateway.cli import resolve_serve_args
from gateway.config_file import ConfigError, CtxgateConfig, interpolate, load_config
from gateway.keys import hash_key
from tests.support.servers import free_port, wait_http

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def _serve_args(argv: list[str]):
    return resolve_serve_args(parse_args(["serve", *argv]))


def test_interpolation_replaces_references_anywhere_and_names_missing_variables(tmp_path):
    env = {"REDIS_URL": "redis://cache:6379/0", "UP1": "http://a:8001", "PORT": "9100"}
    data = {"redis": {"url": "os.environ/REDIS_URL"}, "upstreams": {"urls": ["os.environ/UP1", "http://b"]},
            "server": {"port": "os.environ/PORT", "host": "os.environ.not-a-reference"}}
    assert interpolate(data, env) == {
        "redis": {"url": "redis://cache:6379/0"}, "upstreams": {"urls": ["http://a:8001", "http://b"]},
        "server": {"port": "9100", "host": "os.environ.not-a-reference"}}
    config = load_config(_write(tmp_path / "c.yaml", data), environ=env)
    assert config.server.port == 9100 and config.redis.url == "redis://cache:6379/0"

    with pytest.raises(ConfigError) as missing:
        load_config(_write(tmp_path / "c.yaml", data), environ={"UP1": "x", "PORT": "1"})
    assert str(missing.value) == f"{tmp_path / 'c.yaml'}: field 'redis.url': environment variable REDIS_URL is not set"
    with pytest.raises(ConfigError, match=r"field 'upstreams.urls.0': 'os.environ/1BAD' is not a valid"):
        interpolate({"upstreams": {"urls": ["os.environ/1BAD"]}}, {})


@pytest.mark.parametrize(("data", "message"), [
    ({"server": {"prot": 1}}, "field 'server.prot': Extra inputs are not permitted"),
    ({"server": {"port": 0}}, "field 'server.port': Input should be greater than or equal to 1"),
    ({"engine": {"dtype": "fp8"}}, "field 'engine.dtype': Input should be 'auto', 'float32'"),
    ({"upstreams": {"urls": []}}, "field 'upstreams.urls': List should have at least 1 item"),
    (["server"], "the top level must be a mapping of sections"),
    ({"engine": {"num_kv_blocks": 8, "kv_cache_memory_mb": 64}}, "field 'engine': Value error, set num_kv_blocks"),
])
def test_validation_names_file_field_and_reason(tmp_path, data, message):
    path = _write(tmp_path / "bad.yaml", data)
    with pytest.raises(ConfigError) as error:
        load_config(path, environ={})
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # placeholder values of the wrong type
def test_every_config_key_is_a_serve_flag():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    dests = {action.dest for action in serve._actions}
    # Every leaf set: each must land on a real flag's dest, or it would be silently ignored.
    everything = CtxgateConfig.model_construct(**{
        name: (field.annotation.model_construct(**dict.fromkeys(field.annotation.model_fields, 1))
               if isinstance(field.annotation, type) else "x")
        for name, field in CtxgateConfig.model_fields.items()
    })
    values = everything.flag_values()
    assert len(values) >= 30 and CtxgateConfig().flag_values() == {}
    assert set(values) <= dests


def test_flags_given_override_the_file_which_overrides_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("CG_TEST_PORT", "9123")
    path = _write(tmp_path / "ctxgate.yaml", {
        "server": {"port": "os.environ/CG_TEST_PORT", "max_in_flight": 3, "max_queued": 5},
        "engine": {"prefix_caching": False, "max_model_len": 512},
        "upstreams": {"urls": ["http://file-upstream:8001"], "retries": 4},
        "keys_file": "keys.yaml", "policy_dir": "/etc/ctxgate/policies",
        "logging": {"level": "WARNING"},
    })
    args = _serve_args(["--config", str(path), "--max-queued", "64", "--upstream", "http://flag:1"])
    assert args.port == 9123 and args.max_in_flight == 3  # from the file
    assert args.max_queued == 64  # given explicitly, although it equals the default
    assert args.upstream == ["http://flag:1"] and args.upstream_retries == 4
    assert args.no_prefix_caching is True and args.max_model_len == 512
    assert args.keys == str(tmp_path / "keys.yaml")  # relative to the config file
    assert args.policy_dir == "/etc/ctxgate/policies"
    assert args.host == "127.0.0.1" and args.queue_timeout == 10.0  # untouched defaults
    assert args.log_level == "WARNING"

    assert _serve_args(["--config", str(path), "--log-level", "debug"]).log_level == "DEBUG"
    assert _serve_args([]).port == 8000  # no file: defaults

    sized = _write(tmp_path / "sized.yaml", {"engine": {"kv_cache_memory_mb": 256}})
    flag = _serve_args(["--config", str(sized), "--num-kv-blocks", "64"])
    assert flag.num_kv_blocks == 64 and flag.kv_cache_memory_mb is None  # the flag replaces the file's choice
    assert _serve_args(["--config", str(sized)]).kv_cache_memory_mb == 256


def test_config_cli_check_and_schema(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CG_UNSET", None)
    good = _write(tmp_path / "good.yaml", {"server": {"port": 8100}})
    bad = _write(tmp_path / "bad.yaml", {"redis": {"url": "os.environ/CG_UNSET"}})
    result = subprocess.run([sys.executable, "-m", "ctxgate", "config", "check", str(good), str(bad)],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert result.returncode == 1
    assert f"{good}: ok" in result.stdout
    assert result.stderr.strip() == f"{bad}: field 'redis.url': environment variable CG_UNSET is not set"
    serve = subprocess.run([sys.executable, "-m", "ctxgate", "serve", "--config", str(bad)],
                           capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert serve.returncode == 2 and "Traceback" not in serve.stderr
    assert "environment variable CG_UNSET is not set" in serve.stderr
    schema = subprocess.run([sys.executable, "-m", "ctxgate", "config", "schema"],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    parsed = json.loads(schema.stdout)
    assert {"server", "engine", "upstreams", "redis", "keys_file", "policy_dir"} <= set(parsed["properties"])


def test_serve_runs_from_the_config_file_alone(tmp_path):
    """The port, keys file and upstream come from the file (port via os.environ/), nothing from flags."""
    port = free_port()
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump(
        {"tenants": {"acme": {"keys": [{"sha256": hash_key("cg-config-key")}]}}}))
    path = _write(tmp_path / "ctxgate.yaml", {
        "server": {"port": "os.environ/CG_PORT", "served_model_name": "from-config"},
        "upstreams": {"urls": [f"http://127.0.0.1:{free_port()}"], "model": "from-config"},
        "keys_file": "keys.yaml",
    })
    env = {**os.environ, "PYTHONPATH": str(REPO), "CG_PORT": str(port)}
    env.pop("REDIS_URL", None)
    process = subprocess.Popen([sys.executable, "-m", "ctxgate", "serve", "--config", str(path)],
                               cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", timeout_s=60)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        models = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer cg-config-key"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "from-config"
    finally:
        process.terminate()
        process.wait(timeout=15)
