"""Each tenant's `weight` from the keys file reaches the engine with its requests (and a bad weight is
refused naming the field)."""

from __future__ import annotations

import httpx
import pytest
import yaml

from ctxgate.gateway.app import create_app
from ctxgate.gateway.key_admin import add_key
from ctxgate.gateway.keys import KeyStore, hash_key
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.conftest import RecordingEngine
from tests.support.servers import ServerThread


def set_weight(keys_file, tenant: str, weight) -> None:
    data = yaml.safe_load(keys_file.read_text())
    data["tenants"][tenant]["weight"] = weight
    keys_file.write_text(yaml.safe_dump(data))


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("fair") / "keys.yaml"
    heavy_key = add_key(keys_file, "heavy", policy="passthrough")
    light_key = add_key(keys_file, "light", policy="passthrough")
    set_weight(keys_file, "heavy", 3)
    recording = RecordingEngine(engine)
    app = create_app(GatewaySettings(keys_file=keys_file), engine=recording)
    with ServerThread(app) as running:
        running.recording = recording
        running.keys = {"heavy": heavy_key, "light": light_key}
        running.model = engine.model_name
        yield running


def chat(server, tenant: str, stream: bool) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {server.keys[tenant]}"},
        json={
            "model": server.model,
            "messages": [{"role": "user", "content": "Say one word."}],
            "max_tokens": 2,
            "stream": stream,
        },
        timeout=120,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_two_tenants_weights_from_the_keys_file_reach_the_engine(server, stream: bool):
    before = len(server.recording.requests)
    for tenant in ("heavy", "light"):
        assert chat(server, tenant, stream).status_code == 200
    seen = [(request.tenant, request.weight) for request in server.recording.requests[before:]]
    assert seen == [("heavy", 3.0), ("light", 1.0)]


@pytest.mark.parametrize("weight", [0, -1, 1001, "heavy", None])
def test_a_weight_out_of_range_is_refused_naming_the_field(tmp_path, weight):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(
        yaml.safe_dump({"tenants": {"acme": {"weight": weight, "keys": [{"sha256": hash_key("k")}]}}})
    )
    with pytest.raises(ValueError, match="tenants.acme.weight"):
        KeyStore(keys_file)


def test_a_tenant_without_a_weight_has_the_default_share(tmp_path):
    keys_file = tmp_path / "keys.yaml"
    key = add_key(keys_file, "acme")
    tenant = KeyStore(keys_file).resolve(key)
    assert tenant is not None and tenant.weight == 1.0
