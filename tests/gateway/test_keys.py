"""`ctxgate keys add` prints a key once and stores only its sha256; the key store resolves it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.keys import ANONYMOUS, KeyStore, hash_key

REPO = Path(__file__).resolve().parents[2]


def test_keys_add_cli(tmp_path):
    keys_file = tmp_path / "keys.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "ctxgate", "keys", "add", "acme", "--keys", str(keys_file), "--policy", "rag-strict"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
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
