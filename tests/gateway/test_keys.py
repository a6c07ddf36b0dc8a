"""`ctxgate keys add` prints a key once and stores only its sha256; the key store resolves it."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ctxgate.gateway.keys import ANONYMOUS, KeyRejected, KeyStore, hash_key

REPO = Path(__file__).resolve().parents[2]


def test_keys_add_cli(tmp_path):
    keys_file = tmp_path / "keys.yaml"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxgate",
            "keys",
            "add",
            "acme",
            "--keys-file",
            str(keys_file),
            "--policy",
            "rag-strict",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert key.startswith("cg-") and len(key) > 30
    content = keys_file.read_text()
    assert key not in content and hash_key(key) in content
    tenant = KeyStore(keys_file).resolve(key)
    assert tenant.name == "acme" and tenant.policy == "rag-strict"
    assert KeyStore(keys_file).resolve("cg-other") is None
    assert KeyStore(keys_file).resolve(None) is None


def test_open_mode_and_bad_files(tmp_path):
    assert KeyStore(None).resolve(None) is ANONYMOUS
    with pytest.raises(FileNotFoundError):
        KeyStore(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  acme:\n    keys:\n      - sha256: not-a-hash\n")
    with pytest.raises(ValueError, match="tenants.acme.keys.0.sha256"):
        KeyStore(bad)


def test_invalid_edit_keeps_previous_keys(tmp_path):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"tenants:\n  acme:\n    keys:\n      - sha256: {hash_key('k1')}\n")
    store = KeyStore(keys_file)
    keys_file.write_text("tenants: [oops\n")
    store.refresh()
    assert store.resolve("k1").name == "acme" and "invalid YAML" in store.last_error


def _ctxgate(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ctxgate", *argv], capture_output=True, text=True, cwd=REPO, timeout=60
    )


def test_key_lifecycle_cli(tmp_path):
    keys = str(tmp_path / "keys.yaml")
    added = _ctxgate(
        "keys",
        "add",
        "acme",
        "--keys-file",
        keys,
        "--label",
        "team=search",
        "--label",
        "old note",
        "--expires",
        "30d",
        "--model",
        "smol",
        "--requests-per-minute",
        "60",
        "--max-parallel-requests",
        "4",
        "--budget",
        "20",
        "--budget-period",
        "weekly",
    )
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    other = _ctxgate("keys", "add", "globex", "--keys", keys).stdout.strip()
    key_id, other_id = hash_key(key)[:12], hash_key(other)[:12]

    tenant = KeyStore(keys).authenticate(key)
    assert (
        tenant.name == "acme" and tenant.key.models == ("smol",) and tenant.key.labels == {"team": "search"}
    )
    assert tenant.key.limits == {
        "requests_per_minute": 60,
        "max_parallel_requests": 4,
        "budget": 20.0,
        "budget_period": "weekly",
    }
    listed = [
        json.loads(line)
        for line in _ctxgate("keys", "list", "--keys-file", keys, "--json").stdout.splitlines()
    ]
    assert [row["id"] for row in listed] == [key_id, other_id]
    assert listed[0]["note"] == "old note" and listed[0]["status"] == "active"
    assert 29 <= (datetime.fromisoformat(listed[0]["expires_at"]) - datetime.now(UTC)).days <= 30
    by_label = _ctxgate("keys", "list", "--keys", keys, "--label", "team=search").stdout
    assert key_id in by_label and other_id not in by_label and "requests_per_minute=60" in by_label
    assert other_id not in _ctxgate("keys", "list", "--keys", keys, "--tenant", "acme").stdout

    rotated = _ctxgate("keys", "rotate", key_id, "--keys-file", keys)
    assert rotated.returncode == 0, rotated.stderr
    new_key = rotated.stdout.strip()
    new_tenant = KeyStore(keys).authenticate(new_key)
    assert new_tenant.key.quota_id == key_id and new_tenant.key.limits == tenant.key.limits  # same counters
    with pytest.raises(KeyRejected, match=f"API key {key_id} was revoked at "):
        KeyStore(keys).authenticate(key)
    assert KeyStore(keys).resolve(key) is None
    assert key_id not in _ctxgate("keys", "list", "--keys", keys).stdout
    assert "revoked" in _ctxgate("keys", "list", "--keys", keys, "--all").stdout

    graced = _ctxgate("keys", "rotate", other, "--keys", keys, "--grace", "1h")  # by the key itself
    assert graced.returncode == 0 and "expires at" in graced.stderr
    assert KeyStore(keys).authenticate(other).name == "globex"  # still valid during the grace period
    later = datetime.now(UTC) + timedelta(hours=1, seconds=1)
    with pytest.raises(KeyRejected, match="expired at"):
        KeyStore(keys).authenticate(other, now=later)

    revoked = _ctxgate("keys", "revoke", hash_key(new_key)[:8], "--keys", keys)
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    assert KeyStore(keys).resolve(new_key) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["keys", "add", "acme", "--expires", "soon"], "--expires: 'soon' is neither a duration"),
        (["keys", "add", "acme", "--budget-period", "daily"], "--budget-period needs --budget"),
        (["keys", "revoke", "abc"], "give the key id from `ctxgate keys list`"),
        (["keys", "revoke", "abcdef0123"], "no key 'abcdef0123' in the keys file"),
        (["keys", "rotate", "abcdef0123", "--grace", "1x"], "'1x' is not a duration"),
        (["keys", "list", "--keys-file", "missing.yaml"], "keys file not found: missing.yaml"),
    ],
)
def test_key_cli_errors_are_clear(tmp_path, argv, message):
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants: {}\n")
    if "--keys-file" not in argv:
        argv = [*argv, "--keys-file", str(keys)]
    result = _ctxgate(*argv)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_keys_add_warns_about_a_model_not_served_and_a_budget_without_prices(tmp_path):
    keys = str(tmp_path / "keys.yaml")
    added = _ctxgate("keys", "add", "acme", "--keys-file", keys, "--model", "smollm2-135m", "--budget", "5")
    assert added.returncode == 0 and added.stdout.startswith("cg-")  # warned, still written
    assert (
        "ctxgate: warning: --model smollm2-135m: a `ctxgate serve` without --config (pass --config FILE) "
        "serves SmolLM2-135M-Instruct"
    ) in added.stderr
    assert "--budget 5: policy 'rag-default' has no prices" in added.stderr
    priced = tmp_path / "policies"
    priced.mkdir()
    (priced / "paid.yaml").write_text("name: paid\ncost: {prompt_per_1k: 0.5}\n")
    config = tmp_path / "ctxgate.yaml"
    config.write_text(json.dumps({"server": {"served_model_name": "smol", "policy_dir": str(priced)}}))
    clean = _ctxgate(
        "keys",
        "add",
        "globex",
        "--keys-file",
        keys,
        "--config",
        str(config),
        "--model",
        "smol",
        "--policy",
        "paid",
        "--budget",
        "5",
    )
    assert clean.returncode == 0 and "warning" not in clean.stderr, clean.stderr
    unknown = _ctxgate(
        "keys", "add", "initech", "--keys-file", keys, "--config", str(config), "--policy", "payd"
    )
    assert "ctxgate: warning: --policy payd: no such policy in the server config" in unknown.stderr


def test_keys_file_flag_is_spelt_as_in_serve():
    help_text = _ctxgate("keys", "add", "--help").stdout
    assert "--keys-file FILE, --keys FILE" in help_text and "--keys: deprecated" in help_text
    listed = _ctxgate("keys", "list", "--keys", "missing.yaml")  # the old spelling still works, with a notice
    assert "ctxgate: warning: --keys is deprecated; use --keys-file" in listed.stderr
    assert "keys file not found: missing.yaml" in listed.stderr
