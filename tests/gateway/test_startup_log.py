"""A real `ctxgate serve` says what it serves at startup and writes one access-log line per request."""

from __future__ import annotations

import re

import httpx
import yaml

from ctxgate.gateway.keys import hash_key
from tests.support.servers import ctxgate_process, free_port, wait_http, write_policy

KEY = "cg-startup-log-key"
POLICY = "name: tiny\nmax_input_tokens: 200\nreserve_output_tokens: 4\ndocuments: {max_tokens: 100}\n"


def test_banner_and_access_log_of_a_real_server(model_dir, tmp_path):
    policies = tmp_path / "policies"
    policies.mkdir()
    write_policy(policies, "tiny", POLICY)
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "tenants": {
                    "acme": {"keys": [{"sha256": hash_key(KEY)}, {"sha256": hash_key("cg-other")}]},
                    "globex": {"keys": [{"sha256": hash_key("cg-globex")}]},
                }
            }
        )
    )
    port, log = free_port(), tmp_path / "serve.log"
    args = [
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--num-threads",
        "1",
        "--kv-cache-memory-mb",
        "16",
        "--keys-file",
        str(keys),
        "--policy-dir",
        str(policies),
        "--default-policy",
        "tiny",
        "--served-model-name",
        "tiny-model",
    ]
    with ctxgate_process(args, log):
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/ready", timeout_s=300)
        answer = httpx.post(
            f"{url}/v1/completions",
            timeout=120,
            headers={"authorization": f"Bearer {KEY}", "x-request-id": "startup-1"},
            json={"model": "tiny-model", "prompt": "The capital of France is", "max_tokens": 2},
        )
        assert answer.status_code == 200, answer.text
        refused = httpx.get(
            f"{url}/v1/models", headers={"authorization": "Bearer cg-wrong", "x-request-id": "r-401"}
        )
        assert refused.status_code == 401
    text = log.read_text()
    assert f"ctxgate gateway listening on http://127.0.0.1:{port}" in text
    assert "  models:   tiny-model" in text and "  mode:     built-in engine" in text
    assert f"  keys:     {keys} (2 tenants, 3 keys)" in text
    assert re.search(rf"  policies: \d+ loaded from .*{re.escape(str(policies))}: .*\btiny\b", text)
    assert "  metrics:  /metrics open (no metrics key)" in text
    assert "open mode" not in text
    access = [line for line in text.splitlines() if "ctxgate.access" in line]
    completion = next(line for line in access if "request_id=startup-1 " in line)
    assert re.search(
        r"request_id=startup-1 method=POST path=/v1/completions status=200 tenant=acme policy=[\w-]+ "
        r"prompt_tokens_before=\d+ prompt_tokens_after=\d+ ttft_ms=\d+\.\d duration_ms=\d+\.\d$",
        completion,
    )
    assert any("request_id=r-401 " in line and "status=401 tenant=-" in line for line in access)
    assert KEY not in text
