"""`ctxgate keys show` reads what a key used from the shared ledger (real Redis, a real gateway
in front of it) and says when each limit resets, in the limit's time zone."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import httpx

from ctxgate.gateway.app import create_app
from ctxgate.gateway.key_admin import add_key
from ctxgate.gateway.keys import Limits, ModelLimits
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import ServerThread

REPO = Path(__file__).resolve().parents[2]


def test_keys_show_reads_what_the_key_used_and_when_each_limit_resets(engine, tmp_path, redis_server):
    keys = tmp_path / "keys.yaml"
    model = engine.model_name
    limits = Limits(
        tokens_per_month=100_000,
        time_zone="Europe/Berlin",
        models={model: ModelLimits(requests_per_minute=5)},
    )
    key = add_key(keys, "acme", policy="passthrough", models=[model], limits=limits)
    settings = GatewaySettings(keys_file=keys, redis_url=redis_server.url)
    with ServerThread(create_app(settings, engine=engine)) as gateway:
        reply = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3},
            timeout=60,
        )
    assert reply.status_code == 200, reply.text
    spent = reply.json()["usage"]["total_tokens"]
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxgate",
            "keys",
            "show",
            key,
            "--keys-file",
            str(keys),
            "--json",
            "--redis-url",
            redis_server.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=REPO,
    )
    usage = {(row["limit"], row["model"]): row for row in json.loads(shown.stdout)["usage"]}
    assert usage[("tokens_per_month", None)]["used"] == spent  # settled: the unused output came back
    assert usage[("requests_per_minute", model)]["used"] == 1
    berlin = datetime.now(UTC).astimezone(ZoneInfo("Europe/Berlin"))
    first = datetime(
        berlin.year + berlin.month // 12, berlin.month % 12 + 1, 1, tzinfo=ZoneInfo("Europe/Berlin")
    )
    assert usage[("tokens_per_month", None)]["resets_at"] == first.isoformat()
    table = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxgate",
            "keys",
            "list",
            "--keys-file",
            str(keys),
            "--usage",
            "--redis-url",
            redis_server.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=REPO,
    ).stdout
    assert f"key.tokens_per_month={spent}/100000 resets {first.isoformat()}" in table
