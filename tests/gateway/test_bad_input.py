"""Bad input always gets a 4xx with an OpenAI-style JSON error, never a 500; auth by hashed keys."""

from __future__ import annotations

import httpx
import pytest
import yaml

from ctxgate.gateway.app import create_app
from ctxgate.gateway.key_admin import add_key
from ctxgate.gateway.keys import hash_key
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import ServerThread, write_policy


@pytest.fixture(scope="module")
def secured(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("secured")
    keys_file = root / "keys.yaml"
    # rag-fast: a policy the key may name; "gone": one it may name that is not loaded.
    key = add_key(keys_file, "acme", policy="tiny", policies=["rag-fast", "gone"])
    policy_dir = root / "policies"
    policy_dir.mkdir()
    write_policy(
        policy_dir,
        "tiny",
        "name: tiny\nmax_input_tokens: 64\nreserve_output_tokens: 4\ndocuments: {max_tokens: 32}\n",
    )
    settings = GatewaySettings(policy_dir=policy_dir, keys_file=keys_file, max_body_bytes=64 * 1024)
    with ServerThread(create_app(settings, engine=engine)) as running:
        running.key = key
        running.keys_file = keys_file
        yield running


def _post(
    server,
    path: str,
    content: bytes | str | None = None,
    json_body=None,
    key: str | None = "default",
    headers: dict | None = None,
) -> httpx.Response:
    all_headers = {"content-type": "application/json", **(headers or {})}
    if key == "default":
        key = server.key
    if key is not None:
        all_headers["authorization"] = f"Bearer {key}"
    return httpx.post(f"{server.url}{path}", content=content, json=json_body, headers=all_headers, timeout=60)


def _assert_error(response: httpx.Response, status: int, mentions: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert mentions.lower() in error["message"].lower(), error["message"]
    return error


def _chat(**overrides):
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
    }
    body.update(overrides)
    return body


def test_keys_file_stores_only_hashes(secured):
    stored = yaml.safe_load(secured.keys_file.read_text())
    entry = stored["tenants"]["acme"]
    assert entry["policy"] == "tiny"
    assert entry["keys"][0]["sha256"] == hash_key(secured.key)
    assert secured.key not in secured.keys_file.read_text()


def test_valid_key_uses_the_tenants_policy(secured):
    response = _post(secured, "/v1/chat/completions", json_body=_chat())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["ctxgate"]["tenant"] == "acme"
    assert response.json()["usage"]["ctxgate"]["policy"] == "tiny"


@pytest.mark.parametrize("key, mentions", [(None, "missing API key"), ("cg-wrong", "invalid API key")])
def test_missing_or_bad_key_is_401(secured, key, mentions):
    response = _post(secured, "/v1/chat/completions", json_body=_chat(), key=key)
    _assert_error(response, 401, mentions)
    assert httpx.get(f"{secured.url}/v1/models").status_code == 401


def test_new_key_works_without_restart(secured):
    new_key = add_key(secured.keys_file, "globex")
    deadline = 5.0
    import time

    started = time.monotonic()
    while time.monotonic() - started < deadline:
        response = _post(secured, "/v1/ctxgate/compress", json_body=_chat(), key=new_key)
        if response.status_code == 200:
            break
        time.sleep(0.2)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "content, status, mentions",
    [
        (b"{not json", 400, "malformed JSON"),
        (b"", 400, "empty"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"model": "SmolLM2-135M-Instruct"}', 400, "messages"),
        (b"\xff\xfe\x00", 400, "malformed JSON"),
        (b'{"model": "SmolLM2-135M-Instruct", "messages": [], "temperature": NaN}', 400, "NaN"),
    ],
)
def test_malformed_bodies(secured, content, status, mentions):
    _assert_error(_post(secured, "/v1/chat/completions", content=content), status, mentions)


@pytest.mark.parametrize(
    "body, status, mentions, param",
    [
        (_chat(messages=[]), 400, "messages", "messages"),
        (_chat(messages="hello"), 400, "messages", "messages"),
        (_chat(messages=[{"role": "wizard", "content": "x"}]), 400, "role", "messages.0.role"),
        (_chat(max_tokens="many"), 400, "max_tokens", "max_tokens"),
        (_chat(max_tokens=-3), 400, "max_tokens", "max_tokens"),
        (_chat(temperature=9), 400, "temperature", "temperature"),
        (_chat(n=17), 400, "n", "n"),
        (_chat(guided_regex="("), 400, "guided_regex", "guided_regex"),
        (_chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", "top_logprobs"),
        (_chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, "tools[0]", "tools[0]"),
        (_chat(stream="yes please"), 400, "stream", "stream"),
        (_chat(model="gpt-17"), 404, "gpt-17", "model"),
        (_chat(model=5), 400, "model", "model"),
        (_chat(ctxgate={"policy": "gone"}), 400, "unknown policy", "ctxgate.policy"),
        (_chat(ctxgate={"policy": "no-such-policy"}), 403, "may not use policy", "ctxgate.policy"),
        (_chat(ctxgate={"documents": "not a list"}), 400, "documents", "ctxgate.documents"),
        (_chat(ctxgate={"documents": [{"title": "no text"}]}), 400, "text", "ctxgate.documents.0.text"),
        (
            _chat(ctxgate={"documents": [{"text": "x", "title": "t" * 1001}]}),
            400,
            "at most 1000 characters",
            "ctxgate.documents.0.title",
        ),
        (
            _chat(ctxgate={"documents": [{"text": "x", "id": "i" * 257}]}),
            400,
            "at most 256 characters",
            "ctxgate.documents.0.id",
        ),
        (_chat(ctxgate={"documents": [], "bogus": 1}), 400, "bogus", "ctxgate.bogus"),
        (
            _chat(ctxgate={"overrides": {"max_input_tokens": 10**6}}),
            400,
            "does not allow",
            "ctxgate.overrides",
        ),
        (
            _chat(ctxgate={"policy": "rag-fast", "overrides": {"documents.embed_budget_multiple": 0}}),
            400,
            "embed_budget_multiple",
            "ctxgate.overrides",
        ),
        (_chat(ctxgate={"retrieval": {"index": "wiki"}}), 404, "retrieval", "ctxgate.retrieval.index"),
        (
            _chat(ctxgate={"retrieval": {"index": "../wiki"}}),
            400,
            "invalid index name",
            "ctxgate.retrieval.index",
        ),
        (
            _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            400,
            "image_url",
            "messages",
        ),
        (_chat(messages=[{"role": "user", "content": "word " * 200}]), 413, "max_input_tokens", "messages"),
    ],
)
def test_wrong_values(secured, body, status, mentions, param):
    error = _assert_error(_post(secured, "/v1/chat/completions", json_body=body), status, mentions)
    assert error["param"] == param


def test_oversize_body_is_413(secured):
    big = _chat(ctxgate={"documents": [{"text": "x" * (100 * 1024)}]})
    _assert_error(_post(secured, "/v1/chat/completions", json_body=big), 413, "limit")

    def chunks():  # no content-length: the limit is enforced while reading
        for _ in range(100):
            yield b"x" * 1024

    response = httpx.post(
        f"{secured.url}/v1/chat/completions",
        content=chunks(),
        headers={"authorization": f"Bearer {secured.key}", "content-type": "application/json"},
    )
    _assert_error(response, 413, "limit")


def test_other_endpoints_errors(secured):
    _assert_error(
        _post(secured, "/v1/completions", json_body={"model": "SmolLM2-135M-Instruct", "prompt": ""}),
        400,
        "empty",
    )
    _assert_error(
        _post(secured, "/v1/completions", json_body={"model": "SmolLM2-135M-Instruct", "prompt": ["a", "b"]}),
        400,
        "one prompt",
    )
    _assert_error(
        _post(
            secured, "/v1/completions", json_body={"model": "SmolLM2-135M-Instruct", "prompt": "word " * 100}
        ),
        413,
        "never cut",
    )
    _assert_error(_post(secured, "/v1/ctxgate/compress", json_body={"messages": 3}), 400, "model")
    _assert_error(
        _post(secured, "/v1/chat/completions", content="{}", headers={"content-type": "text/plain"}),
        415,
        "application/json",
    )
    response = httpx.get(f"{secured.url}/v1/chat/completions")
    _assert_error(response, 405, "not allowed")
    _assert_error(httpx.get(f"{secured.url}/nowhere"), 404, "not found")
