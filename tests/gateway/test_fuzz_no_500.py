"""Property: whatever JSON a client sends, the gateway answers with a status below 500."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import write_policy

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
messages = (
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]) | json_values},
            optional={"content": st.text(max_size=40) | json_values, "name": json_values},
        ),
        max_size=3,
    )
    | json_values
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just("SmolLM2-135M-Instruct") | json_values,
        "messages": messages,
        "max_tokens": st.integers(-5, 5) | json_values,
        "temperature": st.floats(-1, 3) | json_values,
        "stream": st.booleans() | json_values,
        "stop": json_values,
        "ctxgate": st.fixed_dictionaries(
            {},
            optional={
                "documents": st.lists(st.fixed_dictionaries({"text": st.text(max_size=30)}), max_size=3)
                | json_values,
                "policy": st.sampled_from(["fuzz", "missing"]) | json_values,
                "overrides": json_values,
                "retrieval": json_values,
            },
        )
        | json_values,
    },
)


@pytest.fixture(scope="module")
def app(engine, tmp_path_factory):
    policy_dir = tmp_path_factory.mktemp("fuzz")
    write_policy(
        policy_dir,
        "fuzz",
        "name: fuzz\nmax_input_tokens: 128\nreserve_output_tokens: 1\n"
        "documents: {max_tokens: 64}\nrerank: {enabled: false}\ndedup: {near_duplicate_cosine: null}\n",
    )
    return create_app(GatewaySettings(policy_dir=policy_dir, default_policy="fuzz"), engine=engine)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/ctxgate/compress", "/v1/completions"]))
async def test_random_bodies_never_500(app, body, path):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as client:
        response = await client.post(path, json=body)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
