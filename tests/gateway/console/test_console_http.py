"""The console through a real server: off without an admin key, the admin key and tenant keys kept
apart, sessions and CSRF enforced, actions written through the keys-file code and audited."""

from __future__ import annotations

import logging

import httpx
import pytest

from ctxgate.gateway.app import create_app
from ctxgate.gateway.keys import hash_key, read_keys_file
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.console.support import POLICY, chat, console_files, csrf_of, logged_in
from tests.support.servers import ServerThread

PAGES = (
    "/console",
    "/console/login",
    "/console/savings",
    "/console/policies",
    "/console/engine",
    "/console/policies/edit?file=console-test.yaml",
    "/console/static/console.css",
)
ACTIONS = (
    "/console/login",
    "/console/logout",
    "/console/keys/create",
    "/console/keys/revoke",
    "/console/keys/rotate",
    "/console/keys/limits",
    "/console/policies/save",
)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return console_files(tmp_path_factory.mktemp("console"))


@pytest.fixture(scope="module")
def server(engine, files):
    settings = GatewaySettings(
        keys_file=files.keys_file,
        policy_dir=files.policy_dir,
        admin_key_file=files.admin_key_file,
        default_policy="console-test",
        reload_interval_s=0.2,
    )
    with ServerThread(create_app(settings, engine=engine)) as running:
        yield running


def test_without_an_admin_key_every_console_route_is_404(engine, files):
    settings = GatewaySettings(keys_file=files.keys_file, policy_dir=files.policy_dir)
    with ServerThread(create_app(settings, engine=engine)) as running:
        for path in PAGES:
            assert httpx.get(running.url + path).status_code == 404, path
        for path in ACTIONS:
            response = httpx.post(running.url + path, data={"admin_key": files.admin_key})
            assert response.status_code == 404, path


def test_unauthenticated_pages_redirect_to_login_and_actions_are_401(server):
    for path in PAGES[2:-1] + ("/console",):
        response = httpx.get(server.url + path)
        assert response.status_code == 303, path
        assert response.headers["location"] == "/console/login"
    for path in ACTIONS[1:]:
        assert httpx.post(server.url + path, data={"key_id": "0" * 12}).status_code == 401, path


def test_the_admin_key_is_refused_by_the_api(server, files):
    for headers in ({"Authorization": f"Bearer {files.admin_key}"}, {"x-api-key": files.admin_key}):
        response = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert response.status_code == 401
        assert "console only" in response.json()["error"]["message"]
    assert chat(server.url, files.admin_key).status_code == 401
    assert (
        httpx.get(
            f"{server.url}/v1/models", headers={"Authorization": f"Bearer {files.tenant_key}"}
        ).status_code
        == 200
    )


def test_a_tenant_key_does_not_open_the_console(server, files):
    bearer = {"Authorization": f"Bearer {files.tenant_key}"}
    response = httpx.get(f"{server.url}/console", headers=bearer)
    assert response.status_code == 303 and response.headers["location"] == "/console/login"
    refused = httpx.post(f"{server.url}/console/login", data={"admin_key": files.tenant_key})
    assert refused.status_code == 401
    assert "set-cookie" not in refused.headers
    assert "Wrong admin key" in refused.text


def test_login_sets_a_strict_http_only_cookie_secure_behind_https(server, files):
    response = httpx.post(f"{server.url}/console/login", data={"admin_key": files.admin_key})
    cookie = response.headers["set-cookie"].lower()
    assert response.status_code == 303
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/console" in cookie
    assert "secure" not in cookie.replace("samesite", "")
    assert files.admin_key not in response.headers["set-cookie"]
    # uvicorn trusts X-Forwarded-Proto from the loopback: the TLS proxy in front of a deployment.
    https = httpx.post(
        f"{server.url}/console/login",
        data={"admin_key": files.admin_key},
        headers={"X-Forwarded-Proto": "https"},
    )
    assert "; secure" in https.headers["set-cookie"].lower()


def test_a_forged_or_tampered_cookie_opens_nothing(server, files):
    client = logged_in(server.url, files.admin_key)
    value = client.cookies["ctxgate_console"]
    session_id, expiry, signature = value.split(".")
    for forged in (f"{session_id}.{int(expiry) + 99999}.{signature}", f"x.{expiry}.{signature}", "a.b.c", ""):
        response = httpx.get(f"{server.url}/console", cookies={"ctxgate_console": forged})
        assert response.status_code == 303, forged


def test_security_headers_on_console_answers(server, files):
    client = logged_in(server.url, files.admin_key)
    for path in ("/console", "/console/savings", "/console/static/console.css", "/console/login"):
        headers = client.get(path).headers
        assert headers["x-frame-options"] == "DENY", path
        assert headers["cache-control"] == "no-store", path
        csp = headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert httpx.get(f"{server.url}/console").headers["x-frame-options"] == "DENY"  # the redirect too


def test_an_action_without_or_with_a_wrong_csrf_token_is_403_and_changes_nothing(server, files):
    client = logged_in(server.url, files.admin_key)
    key_id = hash_key(files.tenant_key)[:12]
    before = files.keys_file.read_bytes()
    for data in ({"key_id": key_id}, {"key_id": key_id, "csrf_token": "0" * 64}):
        response = client.post("/console/keys/revoke", data=data)
        assert response.status_code == 403
        assert "CSRF" in response.text
    assert files.keys_file.read_bytes() == before
    # Another session's token is no better.
    other = logged_in(server.url, files.admin_key)
    response = client.post("/console/keys/revoke", data={"key_id": key_id, "csrf_token": csrf_of(other)})
    assert response.status_code == 403
    assert files.keys_file.read_bytes() == before


def test_create_use_limit_rotate_revoke_a_key_all_audited(server, files, caplog):
    caplog.set_level(logging.INFO, logger="ctxgate.audit")
    client = logged_in(server.url, files.admin_key)
    token = csrf_of(client)
    created = client.post(
        "/console/keys/create",
        data={"csrf_token": token, "tenant": "beta", "policy": "console-test", "requests_per_minute": "50"},
        headers={"x-request-id": "console-create-1"},
    )
    assert created.status_code == 200, created.text
    key = created.text.split('<pre id="new-key">')[1].split("</pre>")[0]
    assert key.startswith("cg-")
    entry = read_keys_file(files.keys_file).tenants["beta"].keys[0]
    assert entry.sha256 == hash_key(key) and entry.limits.requests_per_minute == 50
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert any(
        "action=key.create" in r.message and "request_id=console-create-1" in r.message
        for r in caplog.records
    )
    assert all(key not in r.message for r in caplog.records)

    key_id = entry.key_id
    limited = client.post(
        "/console/keys/limits", data={"csrf_token": token, "key_id": key_id, "tokens_per_minute": "900"}
    )
    assert limited.status_code == 200, limited.text
    limits = read_keys_file(files.keys_file).tenants["beta"].keys[0].limits
    assert limits.tokens_per_minute == 900 and limits.requests_per_minute is None

    rotated = client.post("/console/keys/rotate", data={"csrf_token": token, "key_id": key_id})
    assert rotated.status_code == 200, rotated.text
    new_key = rotated.text.split('<pre id="new-key">')[1].split("</pre>")[0]
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 401
    assert (
        httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {new_key}"}).status_code
        == 200
    )

    revoked = client.post(
        "/console/keys/revoke", data={"csrf_token": token, "key_id": hash_key(new_key)[:12]}
    )
    assert revoked.status_code == 200, revoked.text
    assert (
        httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {new_key}"}).status_code
        == 401
    )
    actions = [r.message for r in caplog.records if r.name == "ctxgate.audit"]
    for action in ("key.create", "key.limits", "key.rotate", "key.revoke"):
        assert any(f"action={action} " in line and "outcome=ok" in line for line in actions), action


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"tenant": "bad name!"}, "tenant"),
        ({"tenant": "gamma", "requests_per_minute": "many"}, "requests_per_minute"),
        ({"tenant": "gamma", "requests_per_minute": "0"}, "requests_per_minute"),
        ({"tenant": "gamma", "budget": "inf"}, "budget"),
        ({"tenant": "gamma", "budget_period": "daily"}, "budget_period"),
        ({"tenant": "gamma", "policy": "no-such-policy"}, "policy"),
        ({"tenant": "gamma", "expires": "tomorrowish"}, "expires"),
        ({"tenant": "gamma", "models": "a b"}, "models"),
    ],
)
def test_a_bad_field_is_a_400_naming_it_and_writes_nothing(server, files, data, field):
    client = logged_in(server.url, files.admin_key)
    before = files.keys_file.read_bytes()
    response = client.post("/console/keys/create", data={"csrf_token": csrf_of(client), **data})
    assert response.status_code == 400
    assert f"field &#39;{field}&#39;" in response.text or f"field '{field}'" in response.text
    assert files.keys_file.read_bytes() == before


def test_unknown_key_id_and_oversized_or_wrongly_typed_forms(server, files):
    client = logged_in(server.url, files.admin_key)
    token = csrf_of(client)
    assert (
        client.post("/console/keys/revoke", data={"csrf_token": token, "key_id": "ffffffffffff"}).status_code
        == 400
    )
    assert (
        client.post("/console/keys/revoke", data={"csrf_token": token, "key_id": "../../x"}).status_code
        == 400
    )
    big = client.post(
        "/console/policies/save", data={"csrf_token": token, "file": "x", "text": "a" * 300_000}
    )
    assert big.status_code == 413
    as_json = client.post("/console/keys/revoke", json={"csrf_token": token, "key_id": "ffffffffffff"})
    assert as_json.status_code == 415


def test_a_bad_policy_edit_shows_the_policy_check_error_and_changes_nothing(server, files):
    client = logged_in(server.url, files.admin_key)
    token = csrf_of(client, "/console/policies/edit?file=console-test.yaml")
    target = files.policy_dir / "console-test.yaml"
    bad = POLICY.replace("max_input_tokens: 220", "max_input_tokens: -5")
    response = client.post(
        "/console/policies/save", data={"csrf_token": token, "file": "console-test.yaml", "text": bad}
    )
    assert response.status_code == 400
    assert "console-test.yaml: field &#39;max_input_tokens&#39;" in response.text
    assert target.read_text() == POLICY
    assert sorted(p.name for p in files.policy_dir.iterdir()) == ["console-test.yaml"]  # no temporary left
    outside = client.post(
        "/console/policies/save", data={"csrf_token": token, "file": "../keys.yaml", "text": POLICY}
    )
    assert outside.status_code == 400


def test_a_good_policy_edit_is_saved_and_in_force(server, files):
    client = logged_in(server.url, files.admin_key)
    token = csrf_of(client, "/console/policies/edit?file=console-test.yaml")
    target = files.policy_dir / "console-test.yaml"
    edited = POLICY.replace("max_input_tokens: 220", "max_input_tokens: 230")
    try:
        response = client.post(
            "/console/policies/save", data={"csrf_token": token, "file": "console-test.yaml", "text": edited}
        )
        assert response.status_code == 200, response.text
        listed = httpx.get(
            f"{server.url}/v1/ctxgate/policies", headers={"Authorization": f"Bearer {files.tenant_key}"}
        ).json()
        (policy,) = [item for item in listed["policies"] if item["name"] == "console-test"]
        assert policy["effective"]["max_input_tokens"] == 230
    finally:
        target.write_text(POLICY)


def test_logout_ends_the_session(server, files):
    client = logged_in(server.url, files.admin_key)
    cookie = client.cookies["ctxgate_console"]
    assert client.post("/console/logout", data={"csrf_token": csrf_of(client)}).status_code == 303
    assert httpx.get(f"{server.url}/console", cookies={"ctxgate_console": cookie}).status_code == 303


def test_pages_render_for_the_admin(server, files):
    client = logged_in(server.url, files.admin_key)
    assert chat(server.url, files.tenant_key).status_code == 200
    tenants = client.get("/console").text
    assert "acme" in tenants and hash_key(files.tenant_key)[:8] in tenants and files.tenant_key not in tenants
    assert "requests per minute" in tenants and "resets" in tenants.lower()
    assert "console-test" in client.get("/console/policies").text
    engine = client.get("/console/engine").text
    assert 'id="running"' in engine and "TTFT" in engine
    assert client.get("/console/savings?range=nonsense").status_code == 400
