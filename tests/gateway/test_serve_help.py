"""`ctxgate serve --help` lists its flags in sections, each settings field in exactly one."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import REPO, ctxgate_env


def test_every_gateway_setting_is_in_exactly_one_help_section():
    listed = Counter(name for names in GatewaySettings.CLI_GROUPS.values() for name in names)
    assert set(listed) == set(GatewaySettings.model_fields)  # a new field must pick its section
    assert max(listed.values()) == 1


def test_serve_help_shows_the_sections_in_order():
    help_text = subprocess.run(
        [sys.executable, "-m", "ctxgate", "serve", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ctxgate_env(),
        timeout=60,
        check=True,
    ).stdout
    sections = [
        line.rstrip(":") for line in help_text.splitlines() if line.endswith(":") and line[0].isalpha()
    ]
    assert sections == [
        "options",
        "server",
        "tenants and policies",
        "quotas and admission",
        "compression",
        "upstreams",
        "engine (the built-in engine; unused with upstreams)",
    ]
    server = help_text.split("\nserver:")[1].split("\ntenants and policies:")[0]
    assert (
        "--port N" in server and "--access-log, --no-access-log" in server and "--max-in-flight" not in server
    )
    engine = help_text.split("\nengine (the built-in engine")[1]
    assert "--max-num-seqs" in engine and "--kv-cache-memory-mb" in engine
