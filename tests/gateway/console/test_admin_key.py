"""The admin key: from `serve --admin-key-file` or the config file's `server.admin_key_file`, checked
before the model loads, kept as a hash, refused by the API even in open mode."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from ctxgate.cli import parse_args
from ctxgate.gateway.app import create_app
from ctxgate.gateway.cli import resolve_serve_args
from ctxgate.gateway.console.admin_key import AdminKeyError, admin_key_problems, load_admin_key
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import ServerThread

KEY = "k" * 40


def test_flag_and_config_file_name_the_file(tmp_path):
    (tmp_path / "admin.key").write_text(KEY + "\n")
    flag = resolve_serve_args(parse_args(["serve", "--admin-key-file", str(tmp_path / "admin.key")]))
    assert flag.settings.admin_key_file == tmp_path / "admin.key"
    config = tmp_path / "ctxgate.yaml"
    config.write_text("server:\n  admin_key_file: admin.key\n")  # relative to the config file
    from_file = resolve_serve_args(parse_args(["serve", "--config", str(config)]))
    assert from_file.settings.admin_key_file == tmp_path / "admin.key"
    assert GatewaySettings().admin_key_file is None


def test_the_key_is_kept_as_its_hash_and_compared_whole(tmp_path):
    path = tmp_path / "admin.key"
    path.write_text(f"  {KEY}\n")
    key = load_admin_key(path)
    assert key.digest == hashlib.sha256(KEY.encode()).digest()
    assert key.matches(KEY)
    assert not key.matches(KEY[:-1]) and not key.matches(KEY + "k") and not key.matches(None)


@pytest.mark.parametrize(
    ("text", "reason"),
    [("short", "5 characters"), (f"{KEY}\n{KEY}", "one line"), (None, "cannot read")],
)
def test_an_unusable_key_file_is_a_preflight_problem_naming_the_setting(tmp_path, text, reason):
    path = tmp_path / "admin.key"
    if text is not None:
        path.write_text(text)
    with pytest.raises(AdminKeyError, match=reason):
        load_admin_key(path)
    (problem,) = admin_key_problems(path)
    assert problem.startswith("field 'server.admin_key_file' (--admin-key-file)") and reason in problem
    assert admin_key_problems(None) == []


def test_the_admin_key_may_not_be_the_metrics_key(engine, tmp_path):
    (tmp_path / "admin.key").write_text(KEY)
    with pytest.raises(AdminKeyError, match="metrics key"):
        create_app(GatewaySettings(admin_key_file=tmp_path / "admin.key", metrics_key=KEY), engine=engine)


def test_open_mode_still_refuses_the_admin_key(engine, tmp_path):
    (tmp_path / "admin.key").write_text(KEY)
    with ServerThread(
        create_app(GatewaySettings(admin_key_file=tmp_path / "admin.key"), engine=engine)
    ) as server:
        assert httpx.get(f"{server.url}/v1/models").status_code == 200  # open: no key needed
        refused = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert refused.status_code == 401
        assert httpx.get(f"{server.url}/console").status_code == 303
