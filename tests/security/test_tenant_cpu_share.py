"""One tenant's flood of cheap requests is held to its share of the gateway's CPU while another
tenant's request is open, and never while it is alone (gateway/cpu_share.py), against a real
gateway (uvicorn, the real engine)."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import httpx
import pytest
import yaml

from ctxgate.gateway.app import create_app
from ctxgate.gateway.keys import hash_key
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.conftest import engine  # noqa: F401
from tests.support.servers import ServerThread

MODEL = "SmolLM2-135M-Instruct"
KEYS = {name: f"cg-{name}-secret" for name in ("flooder", "victim")}
# A hundredth of a core and a millisecond's burst: one refused request puts the flooder in debt.
SHARE = 0.01
BURST_S = 0.001

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory) -> Iterator[ServerThread]:  # noqa: F811
    root = tmp_path_factory.mktemp("cpu-share")
    tenants = {name: {"keys": [{"sha256": hash_key(secret)}]} for name, secret in KEYS.items()}
    (root / "keys.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    settings = GatewaySettings(keys_file=root / "keys.yaml", tenant_cpu_share=SHARE)
    app = create_app(settings, engine=engine)
    app.state.cpu_share.burst_s = BURST_S
    with ServerThread(app) as running:
        yield running


def _refused(server: ServerThread) -> None:
    """A request the engine refuses at admission (a stop token outside the vocabulary): cheap, 400."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say one word. " * 50}],
        "max_tokens": 4,
        "stop_token_ids": [1_000_000_000],
    }
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEYS['flooder']}"},
        timeout=60,
    )
    assert response.status_code == 400, response.text


def _tenant_metric(server: ServerThread, name: str, tenant: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = re.search(rf'^ctxgate:{name}_total{{tenant="{tenant}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _waited_s(server: ServerThread, tenant: str) -> float:
    return _tenant_metric(server, "tenant_cpu_wait_seconds", tenant)


def _charged_s(server: ServerThread, tenant: str) -> float:
    return _tenant_metric(server, "tenant_cpu_seconds", tenant)


def _victim_stream(server: ServerThread, opened: threading.Event, finished: list[str]) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to one hundred."}],
        "max_tokens": 200,
        "min_tokens": 200,
        "temperature": 0,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEYS['victim']}"}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            opened.set()
            if line == "data: [DONE]":
                finished.append("done")


def test_a_flooding_tenant_waits_while_another_streams_and_not_when_alone(server):
    for _ in range(10):
        _refused(server)
    assert _waited_s(server, "flooder") == 0, "alone on the gateway, the flooder is never held back"

    opened, finished = threading.Event(), []
    victim = threading.Thread(target=_victim_stream, args=(server, opened, finished))
    victim.start()
    assert opened.wait(60)
    waited_s = 0.0
    while victim.is_alive() and waited_s == 0:  # the flooder's CPU outgrows its burst, then it waits
        _refused(server)
        waited_s = _waited_s(server, "flooder")
    victim.join(120)
    assert finished == ["done"], "the victim's stream completes"
    assert waited_s > 0, "in debt while the victim streamed, the flooder waited"
    assert _charged_s(server, "flooder") > 0
    assert _waited_s(server, "victim") == 0
