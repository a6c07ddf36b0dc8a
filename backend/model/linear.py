"""The decoder's matmuls: one dispatch for every weight matrix (layers and LM head), and int4 weights.

Which kernel multiplies `x @ W^T` depends on the number of rows of x and on the CPU path
(`ctxgate.backend.platform.cpu_features`), decided once at load time by `configure_matmuls`:

| rows                  | kernel                                                                |
| --------------------- | --------------------------------------------------------------------- |
| <= INT4_MAX_ROWS      | torch's int4pack kernel on 4-bit copies (`--weight-quant int4` only)  |
| <= gemv_max_rows      | the C++ GEMV over bf16 weights (backend/model/csrc), streams W once         |
| more (prefill chunks) | oneDNN bf16 GEMM on prepacked weights where the CPU has native bf16;  |
|                       | else fp32 GEMM on a one-time float32 copy (bf16 GEMM is emulated)     |
|                       | else plain F.linear (float32 models, GPUs)                            |
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ctxgate.backend.platform.cpu_features import CPUPath, onednn_packing_available

logger = logging.getLogger(__name__)

# Up to this many rows the C++ GEMV beats the GEMM path, per kernel build
# (docs/decisions/gemv-row-limits.md).
GEMV_MAX_ROWS = {"avx512_bf16": 2, "avx2": 16, "portable": 2}
# int4 weights for up to this many rows (decode); larger matmuls are faster on oneDNN's bf16 GEMM, so
# prefill keeps 16-bit weights (docs/decisions/gemv-row-limits.md).
INT4_MAX_ROWS = 2
INT4_GROUP_SIZE = 32
# oneDNN's packed-weight GEMM compiles and keeps a primitive per input row count (a megabyte or two
# each, up to a thousand of them), so prompts of ever new lengths would grow the process by gigabytes
# (the fp32 GEMM keeps nothing per shape): packed-GEMM inputs over
# EXACT_SHAPE_ROWS rows are padded to one of SHAPE_STEPS_PER_DOUBLING row counts per doubling, a
# bounded set of shapes whatever lengths tenants send, for at most a sixteenth more rows.
EXACT_SHAPE_ROWS = 64
SHAPE_STEPS_PER_DOUBLING = 16


def gemm_rows(rows: int) -> int:
    """The row count a packed-weight GEMM of `rows` rows runs at (see EXACT_SHAPE_ROWS)."""
    if rows <= EXACT_SHAPE_ROWS:
        return rows
    step = max(1, (1 << (rows.bit_length() - 1)) // SHAPE_STEPS_PER_DOUBLING)
    return -(-rows // step) * step


def quantize_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization in groups along the input dimension.

    Returns torch's packed int4 CPU layout and the [in / group, out, 2] (scale, zero) tensor in the
    weight's dtype, for `w = (q - 8) * scale + zero`. With min/max grids this recovers a Q4_1
    (d * q + m) weight exactly, up to rounding the scales to bfloat16.
    """
    out_features, in_features = weight.shape
    grouped = weight.float().view(out_features, in_features // group_size, group_size)
    low = grouped.amin(dim=-1, keepdim=True)
    high = grouped.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp_min(1e-10)
    q = ((grouped - low) / scale).round_().clamp_(0, 15).to(torch.int32).view(out_features, in_features)
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros.to(weight.dtype)


class Linear(nn.Linear):
    """nn.Linear whose forward picks the kernel for the row count (see the module docstring)."""

    gemv_max_rows: int = 0  # 0: no C++ GEMV
    packed_weight: torch.Tensor | None = None  # oneDNN-reordered bf16 weight
    weight_fp32: torch.Tensor | None = None  # one-time float32 copy for GEMMs of bf16 models
    int4_weight: torch.Tensor | None = None
    int4_scales_and_zeros: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.int4_weight is not None and rows <= INT4_MAX_ROWS:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.int4_weight, INT4_GROUP_SIZE, self.int4_scales_and_zeros
            )
            return out if self.bias is None else out + self.bias
        if self.gemv_max_rows and rows <= self.gemv_max_rows:
            out = torch.ops.ctxgate_cpu.gemv_bf16(x, self.weight)
            return out if self.bias is None else out + self.bias  # Qwen2's Q/K/V biases
        if self.packed_weight is not None:
            padded = gemm_rows(rows)
            x_in = F.pad(x, (0, 0, 0, padded - rows)) if padded > rows else x
            out = torch.ops.mkldnn._linear_pointwise(x_in, self.packed_weight, self.bias, "none", [None], "")
            return out[:rows] if padded > rows else out
        if self.weight_fp32 is not None:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight_fp32, bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def add_int4_copy(self) -> bool:
        if self.in_features % INT4_GROUP_SIZE or self.weight.dtype != torch.bfloat16:
            return False
        self.int4_weight, self.int4_scales_and_zeros = quantize_int4(self.weight)
        return True


@dataclass(frozen=True)
class MatmulPlan:
    """What `configure_matmuls` set up, for the start-up log and the engine's info."""

    gemv_max_rows: int
    prefill: str  # onednn_bf16 | fp32_weights | plain
    fp32_copy_bytes: int
    int4_layers: int

    def summary(self) -> str:
        extra = f", fp32 prefill copy {self.fp32_copy_bytes / 2**20:.0f} MiB" if self.fp32_copy_bytes else ""
        int4 = f", int4 weights in {self.int4_layers} matmuls" if self.int4_layers else ""
        return f"GEMV up to {self.gemv_max_rows} rows, prefill {self.prefill}{extra}{int4}"


def configure_matmuls(
    linears: list[Linear], path: CPUPath, kernels_loaded: bool, device: torch.device, int4: list[Linear]
) -> MatmulPlan:
    """Set every Linear's kernels for this CPU path; `int4` lists the ones that get 4-bit copies."""
    dtype = linears[0].weight.dtype
    on_cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
    gemv_max_rows = GEMV_MAX_ROWS[path.kernel_isa] if on_cpu_bf16 and kernels_loaded else 0
    prefill = "plain"
    if on_cpu_bf16:
        prefill = "onednn_bf16" if path.onednn_bf16 and onednn_packing_available() else "fp32_weights"
    fp32_copy_bytes = 0
    seen: set[int] = set()
    for linear in linears:
        linear.gemv_max_rows = gemv_max_rows
        if prefill == "onednn_bf16":
            linear.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight, 1)
        elif prefill == "fp32_weights":
            linear.weight_fp32 = linear.weight.float()
            if linear.weight.data_ptr() not in seen:  # a tied LM head shares the embedding's bytes
                fp32_copy_bytes += linear.weight_fp32.numel() * 4
        seen.add(linear.weight.data_ptr())
    int4_layers = 0
    if int4:
        if not on_cpu_bf16:
            raise ValueError("int4 weights need bfloat16 on CPU (torch's int4pack CPU kernel)")
        int4_layers = sum(linear.add_int4_copy() for linear in int4)
    return MatmulPlan(gemv_max_rows, prefill, fp32_copy_bytes, int4_layers)
