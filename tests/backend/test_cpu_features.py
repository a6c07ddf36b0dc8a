"""The CPU path: what each kind of x86 CPU gets, and the engine following it on every path this CPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ctxgate.backend.platform import cpu_features
from ctxgate.backend.platform.cpu_features import (
    ISA_CAP_ENV,
    TORCH_ISA_CAPS,
    choose_path,
    cpu_path,
    runnable_kernel_isas,
)

ZEN3 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
SAPPHIRE_RAPIDS = SKYLAKE_X | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni"}


@pytest.mark.parametrize(
    ("flags", "kernel_isa", "auto_dtype", "onednn_bf16", "prefill"),
    [
        (SAPPHIRE_RAPIDS, "avx512_bf16", "bfloat16", True, "onednn_bf16"),
        # AVX-512 without BF16: torch's oneDNN bf16 would run but emulated; fp32 GEMM is faster.
        (SKYLAKE_X, "avx2", "bfloat16", False, "fp32_weights"),
        # An AVX2-only CPU must never reach oneDNN's bf16 reorder (it raises there).
        (ZEN3, "avx2", "bfloat16", False, "fp32_weights"),
        ({"sse4_2"}, "portable", "float32", False, "fp32_weights"),
    ],
)
def test_each_cpu_kind_gets_its_path(flags, kernel_isa, auto_dtype, onednn_bf16, prefill):
    path = choose_path("test cpu", flags)
    assert (path.kernel_isa, path.auto_dtype, path.onednn_bf16, path.prefill_matmul) == (
        kernel_isa,
        auto_dtype,
        onednn_bf16,
        prefill,
    )
    assert kernel_isa in path.summary() and "test cpu" in path.summary()
    assert set(path.flags) <= flags


def test_isa_cap_lowers_the_detected_path(monkeypatch):
    monkeypatch.setenv(ISA_CAP_ENV, "portable")
    cpu_path.cache_clear()
    try:
        path = cpu_path()
        assert path.kernel_isa == "portable" and path.flags == () and path.capped_by == "portable"
        monkeypatch.setenv(ISA_CAP_ENV, "sse9")
        cpu_path.cache_clear()
        with pytest.raises(ValueError, match="avx2 or portable"):
            cpu_path()
    finally:
        monkeypatch.undo()
        cpu_path.cache_clear()


def test_runnable_builds_start_at_the_machines_own():
    runnable = runnable_kernel_isas()
    assert runnable[0] == cpu_path().kernel_isa and runnable[-1] == "portable"
    assert runnable == list(cpu_features.KERNEL_ISAS[cpu_features.KERNEL_ISAS.index(runnable[0]) :])


def test_engine_follows_the_cpu_path(make_engine):
    """dtype auto, the kernels, the matmul dispatch and the reported info all follow cpu_path();
    no oneDNN bf16 weights where the CPU cannot run them. Runs again under each capped path below."""
    path = cpu_path()
    engine = make_engine(dtype="auto", kv_cache_memory_mb=8)
    info = engine.path_info()
    assert info["dtype"] == path.auto_dtype
    assert info["cpu_flags"] == list(path.flags)
    linears = engine.model.linears()
    if path.auto_dtype == "bfloat16":
        assert info["cpu_kernel_isa"] == path.kernel_isa and engine.model.use_fused_layers
        plan = engine.model.matmul_plan
        assert plan is not None and plan.prefill == path.prefill_matmul
        if path.prefill_matmul == "fp32_weights":
            assert all(linear.packed_weight is None and linear.weight_fp32 is not None for linear in linears)
            assert plan.fp32_copy_bytes > 0
        else:
            assert all(linear.packed_weight is not None for linear in linears)
    else:
        assert all(linear.packed_weight is None and linear.gemv_max_rows == 0 for linear in linears)
    tokens = engine.generate([[1, 2, 3, 4, 5] * 5], _greedy(4))[0]
    assert len(tokens) == 4
    assert engine.stats().num_kv_blocks_free == engine.stats().num_kv_blocks_total


def _greedy(max_tokens: int):
    from ctxgate.backend.engine.api import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# The engine tests that depend on the CPU path: kernels under chunked prefill, prefix cache and
# preemption; int8 KV; int4 weights; and the path check above.
CAPPED_ENGINE_TESTS = [
    "tests/backend/test_cpu_features.py::test_engine_follows_the_cpu_path",
    "tests/backend/test_cpu_kernels.py::test_kernel_path_with_chunked_prefill_prefix_cache_and_preemption",
    "tests/backend/test_engine_features.py::test_int8_kv_halves_bytes_and_stays_close",
    "tests/backend/test_weight_quant.py::test_int4_engine_tokens_match_the_float32_reference",
]


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_engine_on_a_lesser_cpu_path(isa):
    """What an AVX2-only (or pre-AVX2) CPU runs, run here in a child process with the CPU capped
    for our kernels and for torch's own (ATen, oneDNN, MKL): bf16 model, int8 KV and int4 weights
    must work there, not raise from inside torch."""
    if isa not in runnable_kernel_isas():  # pragma: no cover - every x86-64 CPU runs both
        pytest.skip(f"this CPU cannot run the {isa} path")
    if isa == cpu_path().kernel_isa and not os.environ.get(ISA_CAP_ENV):
        pytest.skip(f"{isa} is this machine's own path, tested in this process")
    # The cache folder stays shared: the converted model is reused, and kernel builds live in
    # folders named by their ISA.
    env = {**os.environ, ISA_CAP_ENV: isa, **TORCH_ISA_CAPS[isa]}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CAPPED_ENGINE_TESTS],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"{len(CAPPED_ENGINE_TESTS)} passed" in result.stdout, result.stdout[-2000:]


def test_float32_engine_skips_bf16_kernels(make_engine):
    engine = make_engine(dtype="float32", kv_cache_memory_mb=8)
    assert not engine.model.use_fused_layers
    assert all(linear.gemv_max_rows == 0 and linear.weight_fp32 is None for linear in engine.model.linears())
    assert engine.model.embed_tokens.weight.dtype == torch.float32
