"""A model list: two models through one gateway (the built-in engine, and an upstream group of two real
`ctxgate engine serve` processes), keys that may use one model only, and the config file's section."""

from __future__ import annotations

import httpx
import pytest
import yaml
from openai import OpenAI, PermissionDeniedError

from ctxgate.gateway.app import create_app
from ctxgate.gateway.config_file import ConfigError, load_config
from ctxgate.gateway.key_admin import add_key
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.test_config_file import _serve_args
from tests.support.servers import ServerThread, engine_processes


@pytest.fixture(scope="module")
def gateway(engine, model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model-list")
    keys = tmp / "keys.yaml"
    local_only = add_key(keys, "acme", models=["local"])
    remote_only = add_key(keys, "globex", models=["remote"])
    both = add_key(keys, "initech")
    with engine_processes(model_dir, tmp) as engines:
        model_list = [
            {
                "model_name": "remote",
                "routing": "cache_affinity",
                "health": {"probe_interval_s": 0.5},
                "deployments": [{"url": f"{url}/v1", "max_parallel_requests": 4} for url, _ in engines],
            },
            {"model_name": "local", "deployments": [{"engine": "builtin"}]},
        ]
        settings = GatewaySettings(model_list=model_list, keys_file=keys, default_policy="passthrough")
        app = create_app(settings, engine=engine)
        with ServerThread(app) as running:
            running.keys = {"local": local_only, "remote": remote_only, "both": both}
            running.engines = [url for url, _ in engines]
            yield running


def client(gateway, who: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.keys[who], max_retries=0)


def test_both_models_are_served_through_one_gateway(gateway):
    openai = client(gateway, "both")
    assert sorted(model.id for model in openai.models.list()) == ["local", "remote"]
    for model in ("local", "remote"):
        reply = openai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3, temperature=0
        )
        assert reply.choices[0].message.content and reply.model == model
    stream = openai.chat.completions.create(
        model="remote",
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=3,
        temperature=0,
        stream=True,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert 'ctxgate:deployment_requests_total{deployment="builtin",model="local"} 1.0' in metrics
    assert 'ctxgate:deployment_in_flight{deployment="' in metrics
    assert "ctxgate:num_requests_running" in metrics  # the built-in engine's own metrics, still there


@pytest.mark.parametrize(
    ("who", "allowed", "other"), [("local", "local", "remote"), ("remote", "remote", "local")]
)
def test_a_key_allowed_one_model_can_neither_list_nor_use_the_other(gateway, who, allowed, other):
    openai = client(gateway, who)
    assert [model.id for model in openai.models.list()] == [allowed]
    with pytest.raises(PermissionDeniedError) as refused:
        openai.chat.completions.create(
            model=other, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert refused.value.body["code"] == "model_not_allowed"
    unknown = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {gateway.keys[who]}"},
        json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert unknown.status_code == 404 and other not in unknown.text  # the 404 lists only what the key may use
    assert openai.chat.completions.create(
        model=allowed, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    ).choices


def test_a_conversation_stays_on_one_replica(gateway):
    openai = client(gateway, "both")
    messages = [
        {"role": "system", "content": "You answer in one word. " * 6},
        {"role": "user", "content": "Name a colour."},
    ]
    for _ in range(3):
        reply = openai.chat.completions.create(model="remote", messages=messages, max_tokens=2, temperature=0)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or "red"},
            {"role": "user", "content": "Another."},
        ]
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    hits = [
        line for line in metrics.splitlines() if line.startswith("ctxgate:deployment_affinity_hits_total")
    ]
    assert max(float(line.split()[-1]) for line in hits) >= 3, hits  # every turn on its prefix's owner


def test_model_list_in_the_config_file(tmp_path):
    path = tmp_path / "ctxgate.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model_list": [
                    {
                        "model_name": "chat",
                        "routing": "weighted_round_robin",
                        "fallbacks": ["local"],
                        "deployments": [
                            {"url": "http://a:8001/v1", "api_key": "os.environ/ENGINE_KEY", "weight": 2},
                            {"url": "http://b:8001"},
                        ],
                    },
                    {"model_name": "local", "deployments": [{"engine": "builtin"}]},
                ]
            }
        )
    )
    config = load_config(path, environ={"ENGINE_KEY": "s3cret"})
    chat = config.model_list[0]
    assert chat.deployments[0].api_key == "s3cret" and "s3cret" not in repr(chat)
    assert chat.deployments[1].url == "http://b:8001" and chat.routing == "weighted_round_robin"


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"model_name": "a", "deployments": [{"url": "http://x"}]}] * 2, "model_name listed twice: a"),
        ([{"model_name": "a", "fallbacks": ["b"], "deployments": [{"url": "http://x"}]}], "fallback 'b'"),
        (
            [{"model_name": "a", "deployments": [{"url": "http://x", "engine": "builtin"}]}],
            "exactly one of url",
        ),
        ([{"model_name": "a", "deployments": [{"url": "ftp://x"}]}], "http:// or https://"),
        (
            [
                {"model_name": "a", "deployments": [{"engine": "builtin"}]},
                {"model_name": "b", "deployments": [{"engine": "builtin"}]},
            ],
            "one model only",
        ),
        ([{"model_name": "a", "routing": "random", "deployments": [{"url": "http://x"}]}], "routing"),
    ],
)
def test_bad_model_lists_name_the_problem(tmp_path, entries, message):
    path = tmp_path / "ctxgate.yaml"
    path.write_text(yaml.safe_dump({"model_list": entries}))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_serve_reads_the_model_list(tmp_path):
    path = tmp_path / "ctxgate.yaml"
    path.write_text(
        yaml.safe_dump({"model_list": [{"model_name": "chat", "deployments": [{"url": "http://a:1"}]}]})
    )
    resolved = _serve_args(["--config", str(path), "--upstreams", "http://b:2", "--served-model-name", "old"])
    assert [model.model_name for model in resolved.settings.model_list] == ["chat"]
    from ctxgate.gateway.router_setup import with_upstreams

    assert [model.model_name for model in with_upstreams(resolved.settings)] == ["chat", "old"]
