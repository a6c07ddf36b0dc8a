"""The packed-weight oneDNN GEMM runs at a bounded set of row counts (oneDNN keeps a compiled primitive
per shape, so prompts of ever new lengths would otherwise grow the process without end), with results
equal to the unpadded product; the fp32 GEMM path (CPUs without native bf16) gives the same product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctxgate.backend.model.linear import EXACT_SHAPE_ROWS, SHAPE_STEPS_PER_DOUBLING, Linear, gemm_rows
from ctxgate.backend.platform.cpu_features import onednn_packing_available


def test_row_counts_are_a_bounded_set_with_little_padding():
    shapes = {gemm_rows(rows) for rows in range(1, 8193)}
    doublings = (8192 // EXACT_SHAPE_ROWS).bit_length() - 1
    assert len(shapes) <= EXACT_SHAPE_ROWS + SHAPE_STEPS_PER_DOUBLING * doublings
    for rows in range(1, 8193):
        padded = gemm_rows(rows)
        assert rows <= padded <= rows * (1 + 1 / SHAPE_STEPS_PER_DOUBLING)
        assert gemm_rows(padded) == padded  # a padded count is its own shape
    assert all(gemm_rows(rows) == rows for rows in range(1, EXACT_SHAPE_ROWS + 1))


def _linear(kind: str) -> Linear:
    torch.manual_seed(0)
    layer = Linear(96, 80, bias=True).to(torch.bfloat16)
    if kind == "packed":
        if not onednn_packing_available():
            pytest.skip("oneDNN bf16 weight packing is not available on this CPU")
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight, 1)
    else:
        layer.weight_fp32 = layer.weight.float()
    return layer


@pytest.mark.parametrize("kind", ["packed", "fp32_weights"])
@pytest.mark.parametrize("rows", [1, 64, 65, 100, 257, 700])
def test_padded_gemm_equals_the_unpadded_product(kind, rows):
    layer = _linear(kind)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    out = layer(x)
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert out.shape == (rows, 80) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=0.02)
