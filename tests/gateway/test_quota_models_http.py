"""A limit per model inside a key, through a real HTTP server serving two models: the expensive
model's limit refuses (429 naming it, with when it resets) while the key's other model still serves,
and another key of the same tenant is not held to it."""

from __future__ import annotations

import httpx
import pytest

from ctxgate.backend.serving.server import create_app as create_engine_app
from ctxgate.gateway.app import create_app
from ctxgate.gateway.key_admin import add_key
from ctxgate.gateway.keys import Limits, ModelLimits
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.clock import FakeClock
from tests.support.servers import ServerThread

START = 1_700_000_040.0 + 5


@pytest.fixture(scope="module")
def gateway(engine, tmp_path_factory):
    keys = tmp_path_factory.mktemp("model-limits") / "keys.yaml"
    limited = add_key(
        keys,
        "acme",
        models=["small", "big"],
        limits=Limits(requests_per_minute=50, models={"big": ModelLimits(requests_per_minute=2)}),
    )
    unlimited = add_key(keys, "acme", models=["small", "big"])
    clock = FakeClock(START)
    # The same engine behind its own OpenAI server as the second model (not managing the engine: the
    # session's other tests still use it).
    with ServerThread(create_engine_app(engine, served_model_name="big", manage_engine=False)) as upstream:
        model_list = [
            {"model_name": "small", "deployments": [{"engine": "builtin"}]},
            {"model_name": "big", "deployments": [{"url": f"{upstream.url}/v1"}]},
        ]
        settings = GatewaySettings(model_list=model_list, keys_file=keys, default_policy="passthrough")
        with ServerThread(create_app(settings, engine=engine, clock=clock)) as running:
            running.keys = {"limited": limited, "unlimited": unlimited}
            running.clock = clock
            yield running


def _chat(gateway, who: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {gateway.keys[who]}"},
        json={"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2},
        timeout=60,
    )


def test_a_model_limit_in_a_key_holds_while_its_other_model_serves(gateway):
    assert [_chat(gateway, "limited", "big").status_code for _ in range(2)] == [200, 200]
    refused = _chat(gateway, "limited", "big")
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "requests_per_minute"
    assert "for model 'big'" in error["message"] and "2 of 2 requests in the last 60 s" in error["message"]
    assert error["quota"]["model"] == "big" and error["quota"]["scope"] == "key"
    assert error["quota"]["reset_s"] == int(refused.headers["Retry-After"]) == 61  # second 0 leaves at 61
    assert error["quota"]["resets_at"].endswith("+00:00")

    served = _chat(gateway, "limited", "small")
    assert served.status_code == 200, served.text
    reported = served.json()["usage"]["ctxgate"]["quota"]
    assert [(q["limit"], q["scope"], q["model"], q["used"]) for q in reported] == [
        ("requests_per_minute", "key", None, 3)  # the refused request counted nowhere
    ]
    assert served.headers["x-ratelimit-remaining-requests"] == "47"
    # The limit is the key's: another key of the same tenant still uses the big model.
    assert _chat(gateway, "unlimited", "big").status_code == 200

    gateway.clock.advance(61)
    assert _chat(gateway, "limited", "big").status_code == 200
