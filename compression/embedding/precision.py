"""How the embedding model multiplies: bfloat16, int8 or float32, chosen by the CPU path
(`CTXGATE_EMBED_PRECISION` overrides), and the int8 quantization of its Linear layers."""

from __future__ import annotations

import os
from typing import Any

PRECISION_ENV = "CTXGATE_EMBED_PRECISION"
PRECISIONS = ("bfloat16", "int8", "float32")


def choose_precision(kernel_isa: str, requested: str | None = None, amx: bool = False) -> str:
    """How the embedding model multiplies, by the CPU path (backend/platform/cpu_features.py); the matrix
    multiplies are nearly all of the cold-cache compression time.

    - AMX (`amx` true): bfloat16 through oneDNN's native bf16 GEMM on the tile unit, the fastest
      there and within ~0.002 of float32's cosines.
    - AVX-512 BF16 without AMX (AMD EPYC Zen 4, Cooper Lake): int8 dynamic quantization (fbgemm on
      VNNI): faster than bf16 there at the same answer retention
      (docs/decisions/embedder-precision.md).
    - avx2: int8 (~2x faster than float32, where bf16 would be emulated). int8 is noisier on short
      single sentences (cosine to float32's as low as ~0.86), which retention does not show.
    - portable: float32 (fbgemm needs AVX2).
    """
    requested = (requested or "auto").strip().lower()
    native_bf16_gemm = kernel_isa == "avx512_bf16"
    if requested in ("", "auto"):
        if native_bf16_gemm and amx:
            return "bfloat16"
        return "int8" if kernel_isa in ("avx512_bf16", "avx2") else "float32"
    if requested not in PRECISIONS:
        raise ValueError(f"{PRECISION_ENV} must be auto or one of {', '.join(PRECISIONS)}, not {requested!r}")
    if requested == "bfloat16" and not native_bf16_gemm:
        raise ValueError(
            f"{PRECISION_ENV}=bfloat16 needs a CPU with a native bf16 GEMM (AVX-512 BF16 or AMX)"
        )
    return requested


def precision_for_this_cpu() -> str:
    from ctxgate.backend.platform.cpu_features import cpu_path

    path = cpu_path()
    return choose_precision(path.kernel_isa, os.environ.get(PRECISION_ENV), amx="amx_bf16" in path.flags)


def quantize_linear_layers(model: Any) -> None:
    """int8 dynamic quantization of the Linear layers (activations quantized per call)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
