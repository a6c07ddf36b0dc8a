"""Upstream mode: the gateway owns the fields that cost or cross tenants. A real `ctxgate engine
serve` app (real model, behind its own --api-key) is the upstream; what it actually received is
recorded at its HTTP boundary."""

from __future__ import annotations

import hashlib
import hmac
import json

import httpx
import pytest

from ctxgate.gateway.key_admin import add_key
from ctxgate.gateway.keys import Limits
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import ServerThread

SALT_SECRET = "test-salt-secret"
UPSTREAM_KEY = "engine-secret"


class BodyRecorder:
    """ASGI wrapper: keeps every POST body the upstream server receives, as JSON."""

    def __init__(self, app):
        self.app = app
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append(json.loads(b"".join(chunks)))
            return message

        return await self.app(scope, recording_receive, send)


@pytest.fixture(scope="module")
def upstream(model_dir):
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.serving.server import create_app as engine_app

    engine = AsyncEngine(EngineConfig(model=str(model_dir), kv_cache_memory_mb=32, max_model_len=512))
    # drop_params: the built-in engine makes one choice; `n` still reaches it, which is what is checked.
    recorder = BodyRecorder(engine_app(engine, api_key=UPSTREAM_KEY, drop_params=True))
    with ServerThread(recorder) as running:
        running.recorder = recorder
        yield running


@pytest.fixture(scope="module")
def gateway(upstream, model_dir, tmp_path_factory):
    from ctxgate.gateway.app import create_app

    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    running_keys = {
        "alice": add_key(keys, "alice", policy="passthrough"),
        "bob": add_key(keys, "bob", policy="passthrough"),
        # 200 tokens a minute: a short prompt + 50 output tokens fits, four choices of 50 do not.
        "tight": add_key(keys, "tight", policy="passthrough", limits=Limits(tokens_per_minute=200)),
    }
    settings = GatewaySettings(
        upstreams=[f"{upstream.url}/v1"],
        upstream_api_key=UPSTREAM_KEY,
        tokenizer=str(model_dir),
        keys_file=keys,
        default_policy="passthrough",
        cache_salt_secret=SALT_SECRET,
    )
    with ServerThread(create_app(settings)) as running:
        running.keys = running_keys
        yield running


def _post(gateway, tenant: str, path: str = "/v1/chat/completions", **fields) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 2, "temperature": 0}
    body |= (
        {"messages": [{"role": "user", "content": "Say hi."}]}
        if path.endswith("chat/completions")
        else {"prompt": "One, two,"}
    )
    return httpx.post(
        f"{gateway.url}{path}",
        json=body | fields,
        timeout=120,
        headers={"Authorization": f"Bearer {gateway.keys[tenant]}"},
    )


def _expected_salt(tenant: str) -> str:
    return hmac.new(SALT_SECRET.encode(), tenant.encode(), hashlib.sha256).hexdigest()


def test_priority_and_request_id_are_dropped_and_cache_salt_is_the_tenants(gateway, upstream):
    received = upstream.recorder.bodies
    for tenant in ("alice", "bob"):
        for path in ("/v1/chat/completions", "/v1/completions"):
            before = len(received)
            response = _post(
                gateway,
                tenant,
                path,
                priority=-100,
                cache_salt="shared-with-the-victim",
                request_id="another-tenants-request",
            )
            assert response.status_code == 200, response.text
            (body,) = received[before:]
            assert "priority" not in body  # a client cannot jump the upstream's queue
            assert "request_id" not in body  # nor name (and so collide with) another tenant's request
            assert body["cache_salt"] == _expected_salt(tenant)  # the client's salt is overwritten
    salts = {body["cache_salt"] for body in received}
    assert salts == {_expected_salt("alice"), _expected_salt("bob")}  # tenants never share a namespace


def test_n_is_forwarded_and_every_choice_is_reserved(gateway, upstream):
    received = upstream.recorder.bodies
    before = len(received)
    assert _post(gateway, "alice", n=2).status_code == 200
    assert received[before]["n"] == 2
    # 4 x 50 output tokens + the prompt exceed the key's 200 tokens a minute: refused before the
    # upstream is asked; counted as one choice it would have fitted.
    before = len(received)
    refused = _post(gateway, "tight", n=4, max_tokens=50)
    assert refused.status_code == 429, refused.text
    refused_best_of = _post(gateway, "tight", best_of=4, max_tokens=50)
    assert refused_best_of.status_code == 429, refused_best_of.text
    assert len(received) == before
    assert _post(gateway, "tight", n=1, max_tokens=50).status_code == 200
    assert len(received) == before + 1


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"n": 1000}, "n", "unsupported_parameter"),
        ({"best_of": 1000}, "best_of", "unsupported_parameter"),
        ({"best_of": "many"}, "best_of", "invalid_value"),
        ({"best_of": 0}, "best_of", "invalid_value"),
    ],
)
def test_bad_choice_counts_are_a_400_naming_the_field(gateway, fields, param, code):
    response = _post(gateway, "alice", **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
