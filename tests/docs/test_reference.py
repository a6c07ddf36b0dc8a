"""The docs: the generated reference pages name every policy field, config key, keys-file field,
request-extension field, CLI flag and metric (each found here independently of the generator: JSON
schemas, the parsers, the registries' /metrics text), no build-host secret reaches them, the
hand-written pages' examples are valid, and `mkdocs build --strict` passes."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from ctxgate.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PRODUCT_PACKAGES = ("ctxgate", "gateway", "compression", "backend", "policies")


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _load_generator()


@pytest.fixture(scope="module")
def pages(gen) -> dict[str, str]:
    return gen.render_all()


def schema_paths(schema: dict) -> list[str]:
    """Every dotted field path of a JSON schema (`<name>` for a map's key, `[]` for a list item)."""
    defs = schema.get("$defs", {})

    def resolve(node):
        while isinstance(node, dict) and "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[-1]]
        return node

    def objects(node, suffix=""):
        node = resolve(node)
        if not isinstance(node, dict):
            return
        if "properties" in node:
            yield node, suffix
        for option in node.get("anyOf", []) + node.get("allOf", []):
            yield from objects(option, suffix)
        if "items" in node:
            yield from objects(node["items"], suffix + "[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from objects(node["additionalProperties"], suffix + ".<name>")

    def walk(node, prefix):
        for name, prop in node["properties"].items():
            path = prefix + name
            yield path
            for child, suffix in objects(prop):
                yield from walk(child, path + suffix + ".")

    return list(walk(resolve(schema), ""))


def _missing(names, page: str) -> list[str]:
    return [name for name in names if f"`{name}`" not in page]


def test_every_policy_field_is_in_the_policy_reference(pages):
    from ctxgate.policies.schema import Policy

    paths = schema_paths(Policy.model_json_schema())
    assert "documents.embed_min_share" in paths and "quota.on_store_error" in paths
    assert _missing(paths, pages["reference/policy.md"]) == []


def test_every_config_key_and_setting_is_in_the_config_reference(pages):
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.gateway.config_file import CtxgateConfig
    from ctxgate.gateway.settings import GatewaySettings

    page = pages["reference/config.md"]
    keys = schema_paths(CtxgateConfig.model_json_schema())
    assert "engine.kv_cache_dtype" in keys and "server.upstream_api_key" in keys
    assert _missing(keys, page) == []
    for settings in (GatewaySettings, EngineConfig):
        names = (
            [f.name for f in dataclasses.fields(settings)]
            if dataclasses.is_dataclass(settings)
            else list(settings.model_fields)
        )
        assert _missing(names, page) == [], settings.__name__


def test_every_config_key_names_the_serve_flag_that_sets_it(pages):
    from ctxgate.gateway.config_file import CtxgateConfig

    serve_flags = {option for action in _serve_parser()._actions for option in action.option_strings}
    # model_list is a list of groups: the file's alone, no flag sets it.
    leaves = [
        path
        for path in schema_paths(CtxgateConfig.model_json_schema())
        if ("." in path or not _is_section(CtxgateConfig, path)) and not path.startswith("model_list")
    ]
    rows = {
        match.group(1): match.group(2)
        for match in re.finditer(
            r"^\| `([\w.]+)` \|[^|]*\|[^|]*\| `(--[\w-]+)` \|", pages["reference/config.md"], re.M
        )
    }
    without = [path for path in leaves if path not in rows]
    assert without == [], "config keys without a flag in the reference"
    assert set(rows.values()) <= serve_flags
    assert rows["server.max_in_flight"] == "--max-in-flight" and rows["server.keys_file"] == "--keys-file"


def _is_section(model, name: str) -> bool:
    from pydantic import BaseModel

    annotation = model.model_fields[name].annotation
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _serve_parser() -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise AssertionError("no serve command")


def test_config_reference_shows_the_flag_defaults_not_null(pages):
    page = pages["reference/config.md"]
    assert re.search(r"^\| `server.port` \| [^|]* \| `8000` \|", page, re.M)
    assert re.search(r"^\| `engine.enable_prefix_caching` \| [^|]* \| `true` \|", page, re.M)
    assert re.search(r"^\| `engine.threads` \| `engine.num_threads` \|", page, re.M)  # an old key, still read


def test_every_keys_file_and_request_field_is_documented(pages):
    from ctxgate.gateway.keys import KeysFile
    from ctxgate.gateway.schemas import CtxgateExtras

    keys = schema_paths(KeysFile.model_json_schema())
    assert "tenants.<name>.keys[].limits.budget_period" in keys
    assert _missing(keys, pages["reference/keys.md"]) == []
    request = schema_paths(CtxgateExtras.model_json_schema())
    assert "retrieval.top_n" in request and "documents[].text" in request
    assert _missing(request, pages["reference/request.md"]) == []


def _commands(parser: argparse.ArgumentParser, path: str = "ctxgate"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{path} {name}")


def test_every_command_and_flag_is_in_the_cli_reference(pages):
    page = pages["reference/cli.md"]
    sections = dict(re.findall(r"^## `(ctxgate[^`]*)`\n(.*?)(?=^## |\Z)", page, re.M | re.S))
    missing = []
    count = 0
    for path, parser in _commands(build_parser()):
        if path not in sections:
            missing.append(path)
            continue
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            for option in action.option_strings or [action.metavar or action.dest]:
                count += 1
                if option not in sections[path]:
                    missing.append(f"{path} {option}")
    assert count > 100
    assert missing == []


def _metric_names(registry) -> set[str]:
    text = generate_latest(registry).decode()
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    # prometheus-client's `<counter or histogram>_created` companions (the page says so once).
    return {
        name
        for name in names
        if not (name.endswith("_created") and names & {name[:-8], name[:-8] + "_total"})
    }


def test_every_metric_is_in_the_metrics_reference(pages):
    from ctxgate.backend.engine.metrics import EngineMetrics, export_vllm_names
    from ctxgate.backend.routing.deployment_metrics import DeploymentMetrics, DeploymentState
    from ctxgate.backend.routing.upstream import UpstreamClient, UpstreamConfig
    from ctxgate.gateway.admission import AdmissionCollector, AdmissionController
    from ctxgate.gateway.metrics import GatewayMetrics

    gateway = GatewayMetrics()
    gateway.registry.register(AdmissionCollector(AdmissionController(4, 4, 1.0)))
    engine = EngineMetrics("m")
    export_vllm_names(engine)
    upstream = UpstreamClient(UpstreamConfig(urls=["http://127.0.0.1:9"]))
    deployments = DeploymentMetrics()
    deployments.watch(lambda: [DeploymentState("m", "builtin", 0, True)])
    names = set()
    for registry in (gateway.registry, engine.registry, upstream.metrics.registry, deployments.registry):
        names |= _metric_names(registry)
    assert {
        "ctxgate:gateway_requests_total",
        "ctxgate:admission_in_flight",
        "ctxgate:upstream_up",
        "vllm:num_requests_waiting",
        "process_cpu_seconds_total",
        "ctxgate:deployment_in_flight",
        "ctxgate:deployment_affinity_hits_total",
    } <= names
    page = pages["reference/metrics.md"]
    assert _missing(sorted(names), page) == []
    assert "| `ctxgate:quota_rejections_total` | counter | `tenant`, `reason` |" in page
    assert "`_created`" in page


def test_no_build_host_environment_reaches_the_reference(gen, monkeypatch):
    secret = "sk-build-host-secret-1234"
    for name in (
        "REDIS_URL",
        "CTXGATE_UPSTREAM_API_KEY",
        "CTXGATE_ENGINE_API_KEY",
        "CTXGATE_EMBED_CACHE_URL",
    ):
        monkeypatch.setenv(name, f"redis://{secret}" if "URL" in name else secret)
    for page in (gen.cli_page(), gen.config_page()):
        assert secret not in page


def test_every_environment_variable_the_product_reads_is_documented():
    names = set()
    for package in PRODUCT_PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            names |= set(re.findall(r"[\"'](CTXGATE_[A-Z0-9_]+|REDIS_URL)[\"']", path.read_text()))
    assert "CTXGATE_CACHE_DIR" in names
    page = (DOCS / "configuration.md").read_text()
    assert sorted(name for name in names if f"`{name}`" not in page) == []


def _yaml_blocks(page: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)


def test_the_policy_example_is_a_valid_policy():
    from ctxgate.policies.schema import Policy

    policy = Policy.model_validate(yaml.safe_load(_yaml_blocks(DOCS / "policies.md")[0]))
    assert policy.name == "support-bot"


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav(gen):
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages_of(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                yield from pages_of(value)
            else:
                yield value

    nav = set(pages_of(config["nav"]))
    written = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")} | set(gen.PAGES)
    assert nav == written


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="the docs extra (mkdocs, mkdocs-material) is not installed",
)
def test_mkdocs_builds_strict(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "NO_MKDOCS_2_WARNING": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr
    site = tmp_path / "site"
    for page in ("reference/policy", "reference/cli", "reference/metrics", "quickstart"):
        assert (site / f"{page}.html").exists()
    # use_directory_urls: false, so site/ browses from disk: every relative link names a file.
    broken, checked = [], 0
    for html in site.rglob("*.html"):
        for href in re.findall(r'href="([^"#:?]+)(?:#[^"]*)?"', html.read_text()):
            if not href.startswith("/") and not (html.parent / href).resolve().is_file():
                broken.append(f"{html.relative_to(site)} -> {href}")
            checked += 1
    assert broken == [] and checked > 1000
    for chart in ("e2e-144q.png", "retention-vs-longllmlingua.png", "slo-goodput.png"):
        assert (
            chart in (site / "benchmarks.html").read_text()
            and (site / "assets" / "benchmarks" / chart).is_file()
        )


def test_every_policy_keys_file_and_request_field_has_a_description(gen):
    """The reference's Description column is never empty: a field without `Field(description=...)`
    (or a comment the generator reads) fails here, naming it."""
    from ctxgate.gateway.keys import KeysFile
    from ctxgate.gateway.schemas import CtxgateExtras
    from ctxgate.policies.schema import Policy

    empty = [
        f"{root.__name__}: {row.name}"
        for root in (Policy, KeysFile, CtxgateExtras)
        for _, _, rows in gen.model_sections(root)
        for row in rows
        if not row.description.strip()
    ]
    rows = sum(
        len(rows) for root in (Policy, KeysFile, CtxgateExtras) for _, _, rows in gen.model_sections(root)
    )
    assert rows > 90
    assert empty == []
