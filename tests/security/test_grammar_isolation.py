"""One tenant cannot deny structured output to another (issue 48, item 2), against a real gateway
on the real engine: the issue's 600-deep schema is refused at once, and while tenant b floods
slow-but-legal schemas, tenant c's trivial schema is answered in its normal time."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
import yaml

from ctxgate.gateway.keys import hash_key
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.conftest import engine  # noqa: F401
from tests.support.hostile_schemas import TRIVIAL, nested_arrays, slow_schema
from tests.support.servers import ServerThread

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"b": "cg-b-secret", "c": "cg-c-secret"}


@pytest.fixture(scope="module")
def gateway(engine, tmp_path_factory):  # noqa: F811 (the engine fixture)
    from ctxgate.gateway.app import create_app

    keys = tmp_path_factory.mktemp("grammar") / "keys.yaml"
    tenants = {name: {"keys": [{"sha256": hash_key(secret)}]} for name, secret in KEYS.items()}
    keys.write_text(yaml.safe_dump({"tenants": tenants}))
    app = create_app(GatewaySettings(keys_file=keys, default_policy="passthrough"), engine=engine)
    with ServerThread(app) as running:
        yield running.url


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    }


async def _post(
    client: httpx.AsyncClient, url: str, tenant: str, schema: dict[str, Any]
) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = await client.post(
        f"{url}/v1/chat/completions", json=_body(schema), headers={"Authorization": f"Bearer {KEYS[tenant]}"}
    )
    return time.perf_counter() - started, response


def test_the_issues_deep_schema_is_refused_at_once(gateway):
    async def run() -> tuple[float, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await _post(client, gateway, "b", nested_arrays(600))

    took, response = asyncio.run(run())
    assert response.status_code == 400 and took < 1.0
    error = response.json()["error"]
    assert error["param"] == "response_format" and "deeper than" in error["message"]


def test_a_tenant_flooding_slow_schemas_does_not_delay_another_tenants_trivial_one(gateway):
    async def run() -> tuple[float, float, httpx.Response, list[Any]]:
        async with httpx.AsyncClient(timeout=120) as client:
            for title in ("warm", "alone"):  # the first may wait for the workers' start
                alone, response = await _post(client, gateway, "c", TRIVIAL | {"title": title})
                assert response.status_code == 200, response.text
            flood = [
                asyncio.create_task(_post(client, gateway, "b", slow_schema(f"f{i}_"))) for i in range(12)
            ]
            await asyncio.sleep(0.5)
            took, response = await _post(client, gateway, "c", TRIVIAL)
            return alone, took, response, await asyncio.gather(*flood)

    alone, took, response, flood = asyncio.run(run())
    assert response.status_code == 200, response.text  # not "did not compile within 5s"
    assert took < 2.0, f"tenant c's trivial schema took {took:.2f} s under the flood ({alone:.2f} s alone)"
    # b is served one compile at a time and told when it queues too many; never a 5xx but a busy 503.
    assert {r.status_code for _, r in flood} <= {200, 400, 429, 503}
