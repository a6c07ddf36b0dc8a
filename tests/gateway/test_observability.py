"""Request ids, the access log, process/admission/upstream metrics, vLLM names, and the shipped
Grafana dashboard and Prometheus alerts checked against what running gateways really export.

Two gateways share the session's real engine: one runs it in-process (with vLLM names on), the other
reaches it over HTTP through `ctxgate.backend.serving.server` as an upstream, as deploy/compose.yaml does.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI

from ctxgate.backend.engine.metrics import export_vllm_names
from ctxgate.backend.serving.server import create_app as create_engine_app
from ctxgate.gateway.app import create_app
from ctxgate.gateway.keys import hash_key
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import ServerThread, write_policy

REPO = Path(__file__).resolve().parents[2]
MODEL = "ctxgate-test"
KEY = "cg-observability-key"
PROMPT = "The capital of France is"
POLICY = "name: tiny\nmax_input_tokens: 200\nreserve_output_tokens: 4\ndocuments: {max_tokens: 100}\n"


@pytest.fixture(scope="module")
def servers(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("observability")
    write_policy(root, "tiny", POLICY)
    keys_file = root / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"tenants": {"acme": {"keys": [{"sha256": hash_key(KEY)}]}}}))
    export_vllm_names(engine.metrics)
    common = {
        "policy_dir": root,
        "default_policy": "tiny",
        "served_model_name": MODEL,
        "keys_file": keys_file,
        "access_log": True,
    }
    with (
        ServerThread(
            create_engine_app(engine, served_model_name=MODEL, manage_engine=False)
        ) as engine_server,
        ServerThread(create_app(GatewaySettings(**common), engine=engine)) as in_process,
        ServerThread(
            create_app(GatewaySettings(**common, upstreams=[engine_server.url], upstream_model=MODEL))
        ) as via_upstream,
    ):
        yield in_process.url, via_upstream.url


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_request_id_round_trip_and_access_log(servers, caplog):
    url = servers[0]
    caplog.set_level(logging.INFO, logger="ctxgate.access")
    raw = _client(url).completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, extra_headers={"x-request-id": "client-req.42:a"}
    )
    assert raw.headers["x-request-id"] == "client-req.42:a"
    assert raw.parse().choices[0].text is not None

    generated = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])
    # A value that could forge log lines or flood them is replaced, not echoed.
    forged = httpx.get(f"{url}/health", headers={"x-request-id": "a b\tc" + "x" * 200})
    assert re.fullmatch(r"[0-9a-f]{32}", forged.headers["x-request-id"])
    unauthorised = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT},
        headers={"authorization": "Bearer cg-wrong-secret", "x-request-id": "r-401"},
    )
    assert unauthorised.status_code == 401 and unauthorised.headers["x-request-id"] == "r-401"

    assert httpx.get(f"{url}/no/such%0Apath=forged status=200").status_code == 404

    lines = [record.getMessage() for record in caplog.records if record.name == "ctxgate.access"]
    assert any("path=/no/such%0Apath=forged%20status=200 status=404" in line for line in lines)
    assert not any("\n" in line for line in lines)
    completion = next(line for line in lines if "request_id=client-req.42:a" in line)
    assert re.fullmatch(
        r"request_id=client-req.42:a method=POST path=/v1/completions status=200 tenant=acme "
        r"policy=\S+ prompt_tokens_before=\S+ prompt_tokens_after=\S+ ttft_ms=\S+ "
        r"duration_ms=\d+\.\d",
        completion,
    )
    assert any("path=/v1/completions status=401" in line and "tenant=-" in line for line in lines)
    everything = "\n".join(lines)
    assert KEY not in everything and "cg-wrong-secret" not in everything and PROMPT not in everything


def test_process_admission_upstream_and_vllm_metrics(servers):
    in_process, via_upstream = servers
    _client(via_upstream).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    local = httpx.get(f"{in_process}/metrics").text
    for line in (
        "ctxgate:admission_in_flight 0.0",
        "ctxgate:admission_queued 0.0",
        "ctxgate:admission_max_in_flight 64.0",
    ):
        assert line in local
    for name in (
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "python_info",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "ctxgate:num_requests_waiting",
    ):
        assert re.search(rf"^{re.escape(name)}[{{ ]", local, re.M), name
    remote = httpx.get(f"{via_upstream}/metrics").text
    assert re.search(r'^ctxgate:upstream_up\{upstream="http://127\.0\.0\.1:\d+"\} 1\.0$', remote, re.M)
    count = re.search(r'^ctxgate:upstream_request_seconds_count\{upstream="[^"]+"\} (\S+)$', remote, re.M)
    assert count and float(count.group(1)) >= 1
    assert re.search(
        r'^ctxgate:upstream_failures_total\{kind="connect",upstream="[^"]+"\} 0\.0$', remote, re.M
    )


# -- dashboard and alert queries -----------------------------------------------------------------
_PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
_SYNTHETIC = {"up"}  # written by Prometheus itself for every target


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression reads: identifiers that are not functions, keywords or labels."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # string literals (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r"\$\w+", "", expr)  # Grafana variables
    names = re.findall(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)(?![A-Za-z0-9_:]|\s*\()", expr)
    return {name for name in names if name.lower() not in _PROMQL_KEYWORDS}


def _exported_series(metrics_text: str) -> set[str]:
    """Every series name /metrics exports, including families that have no samples yet."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
        "gauge": ("",),
        "untyped": ("",),
    }
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            if kind == "counter":  # the text format names a counter's family with its _total already
                family = family.removesuffix("_total")
            names.update(family + suffix for suffix in suffixes.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.match(r"[^{ ]+", line).group(0))
    return names


def _shipped_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((REPO / "deploy/grafana/ctxgate.json").read_text())
    queries = [
        (f"panel '{panel['title']}'", target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(
                (
                    f"variable {variable['name']}",
                    re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", variable["query"]["query"]),
                )
            )
    alerts = yaml.safe_load((REPO / "deploy/prometheus/alerts.yml").read_text())
    for group in alerts["groups"]:
        for rule in group["rules"]:
            assert {"alert", "expr", "labels", "annotations"} <= set(rule), rule
            queries.append((f"alert {rule['alert']}", rule["expr"]))
    return queries


def test_promql_name_extraction():
    expr = (
        "histogram_quantile(0.95, sum by (le, upstream) (rate(ctxgate:upstream_ttft_seconds_bucket"
        '{instance=~"$instance",status=~"5.."}[$__rate_interval]))) > 8e9 and on (instance) up == 0'
    )
    assert promql_metric_names(expr) == {"ctxgate:upstream_ttft_seconds_bucket", "up"}


def test_dashboard_and_alert_queries_use_exported_metrics(servers):
    exported = set()
    for url in servers:
        exported |= _exported_series(httpx.get(f"{url}/metrics").text)
    queries = _shipped_queries()
    assert len(queries) >= 40
    used = set()
    for where, expr in queries:
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        missing = names - exported - _SYNTHETIC
        assert not missing, f"{where} queries {sorted(missing)}, which no gateway exports"
        used |= names
    assert {"ctxgate:admission_in_flight", "ctxgate:upstream_up", "process_resident_memory_bytes"} <= used


def test_the_access_log_carries_what_the_service_noted(caplog):
    """The figures `note_usage` records inside a request (the service calls it when usage is
    settled) reach that request's line, through the real middleware and a real HTTP server."""
    from fastapi import FastAPI

    from ctxgate.gateway.request_id import RequestId, note_tenant, note_usage

    app = FastAPI()

    @app.get("/noted")
    async def noted() -> dict[str, str]:
        note_tenant("acme")
        note_usage(policy="rag-default", original_prompt_tokens=1840, prompt_tokens=412, ttft_ms=388.14)
        return {}

    app.add_middleware(RequestId)  # the default: access log on
    caplog.set_level(logging.INFO, logger="ctxgate.access")
    with ServerThread(app) as server:
        assert httpx.get(f"{server.url}/noted", headers={"x-request-id": "n-1"}).status_code == 200
        assert httpx.get(f"{server.url}/health", headers={"x-request-id": "n-2"}).status_code == 404
    lines = {
        record.getMessage().split()[0]: record.getMessage()
        for record in caplog.records
        if record.name == "ctxgate.access"
    }
    assert re.fullmatch(
        r"request_id=n-1 method=GET path=/noted status=200 tenant=acme policy=rag-default "
        r"prompt_tokens_before=1840 prompt_tokens_after=412 ttft_ms=388\.1 duration_ms=\d+\.\d",
        lines["request_id=n-1"],
    )
    assert re.fullmatch(
        r"request_id=n-2 method=GET path=/health status=404 tenant=- policy=- "
        r"prompt_tokens_before=- prompt_tokens_after=- ttft_ms=- duration_ms=\d+\.\d",
        lines["request_id=n-2"],
    )
