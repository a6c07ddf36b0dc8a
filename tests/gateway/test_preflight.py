"""`ctxgate serve` checks the files it names before loading a model: a wrong one fails at once."""

from __future__ import annotations

import subprocess
import sys
import time

import yaml

from tests.support.servers import REPO, ctxgate_env


def _serve(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "ctxgate", "serve", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ctxgate_env(),
        timeout=60,
    )
    return result, time.perf_counter() - started


def test_missing_keys_file_and_policy_folder_fail_before_the_model_loads(tmp_path):
    keys, policies = tmp_path / "keys.yaml", tmp_path / "policies"
    result, elapsed = _serve("--keys-file", str(keys), "--policy-dir", str(policies), "--port", "1")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"ctxgate serve: field 'server.keys_file' (--keys-file): keys file not found: {keys} "
        f"(create it with `ctxgate keys add TENANT --keys-file {keys}`)",
        f"ctxgate serve: field 'server.policy_dir' (--policy-dir): policy folder not found: {policies}",
    ]
    # No engine, no tokenizer: the whole process (interpreter start included) is a few seconds on
    # a busy 2-core machine, where loading the model took 14 s.
    assert elapsed < 10, elapsed


def test_a_broken_policy_and_an_unknown_default_fail_before_the_model_loads(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: bad\nextraction: {neighbors: 1}\n")
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"tenants": {}}))
    result, _ = _serve("--keys-file", str(keys), "--policy-dir", str(tmp_path), "--default-policy", "nope")
    assert result.returncode == 2
    assert f"{tmp_path / 'bad.yaml'}: field 'extraction.neighbors'" in result.stderr
    assert "field 'server.default_policy' (--default-policy): no policy named 'nope'" in result.stderr
    assert "Traceback" not in result.stderr
