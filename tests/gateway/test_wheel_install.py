"""`pip install` of the wheel + `ctxgate model prepare` is enough for a working `ctxgate serve`.

The wheel is built from a clean copy of the tracked sources and installed (without dependencies,
which this environment already has) into its own directory; the commands then run from there, with
an empty model cache, so nothing from the source tree or an earlier preparation can help.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.support.servers import free_port, wait_http

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    source = root / "src"
    for name in files:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
            str(source),
        ],
        check=True,
        timeout=300,
    )
    return next((root / "dist").glob("ctxgate-*.whl"))


def test_wheel_carries_every_runtime_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    # One namespace: nothing but ctxgate/ and the dist-info at the top of site-packages.
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"ctxgate"}, top
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in packages.items():  # every package of every mapped folder, nested ones too
        for init in (REPO / folder).rglob("__init__.py"):
            inside = init.relative_to(REPO / folder).as_posix()
            assert f"{package.replace('.', '/')}/{inside}" in names, inside
    assert {
        "ctxgate/gateway/config_file.py",
        "ctxgate/gateway/request_id.py",
        "ctxgate/backend/routing/upstream_metrics.py",
        "ctxgate/backend/model/csrc/cpu_kernels.cpp",
        "ctxgate/policies/rag-default.yaml",
    } <= names
    entry_points = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    )
    assert "ctxgate = ctxgate.cli:main" in entry_points
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    requirements = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    for eval_only in ("matplotlib", "openai", "pysbd"):  # a plain install carries no eval packages
        lines = [line for line in requirements if line.split()[1].startswith(eval_only)]
        assert lines and all('extra == "eval"' in line for line in lines), lines


def test_installed_wheel_prepares_the_model_and_serves(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        timeout=300,
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "CTXGATE_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "CTXGATE_CPU_KERNELS": "0",
    }  # compiling the C++ kernels here would only cost time
    env.pop("REDIS_URL", None)

    def ctxgate(*argv: str, **kwargs):
        return subprocess.run(
            [sys.executable, "-m", "ctxgate", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            **kwargs,
        )

    where = subprocess.run(
        [sys.executable, "-c", "import ctxgate.gateway.config_file as m; print(m.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(site))  # the installed copy runs, not the source tree
    prepared = ctxgate("model", "prepare", timeout=600)
    assert prepared.returncode == 0, prepared.stderr
    assert Path(prepared.stdout.strip()).is_relative_to(tmp_path / "cache")

    port = free_port()
    (tmp_path / "ctxgate.yaml").write_text(
        f"server: {{port: {port}, served_model_name: smol}}\n"
        "engine: {max_model_len: 512, kv_cache_memory_mb: 32}\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "ctxgate", "serve", "--config", "ctxgate.yaml"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", timeout_s=180)
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "smol", "prompt": "Hello", "max_tokens": 2},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1
    finally:
        process.terminate()
        process.wait(timeout=30)
