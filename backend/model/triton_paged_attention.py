"""Paged decode attention as a Triton kernel: each decode row reads its K/V straight from the paged
pool through its block table, so no per-step gathered copy of the context is made.

This module imports `triton` at the top; `ctxgate.backend.model.attention_cuda` imports it only when a CUDA
backend runs (or a test asks for Triton's CPU interpreter), so the CPU engine never needs triton.

Under Triton's CPU interpreter (TRITON_INTERPRET=1 in the environment before triton is first
imported: triton.language's own helpers are compiled or interpreted at import) the same kernel
runs on CPU tensors, which is how the tests check it without a GPU.

One program handles one (sequence, kv head) pair and all query heads of that head's GQA group:
the group shares every K/V value it loads. Blocks are visited in order with an online softmax in
float32 (running max, running sum, rescaled accumulator), as flash-decoding does per split.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Whether triton runs in interpreter mode (fixed at its import, see the module docstring).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    q_ptr,
    keys_ptr,
    values_ptr,
    key_scales_ptr,
    value_scales_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale,
    stride_q_row,
    stride_q_head,
    stride_out_row,
    stride_out_head,
    stride_cache_head,
    stride_cache_slot,
    stride_scales_head,
    stride_table_row,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    group_rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    block_offsets = tl.arange(0, BLOCK_SIZE)
    row_is_head = group_rows < GROUP  # GROUP_PAD rounds the group up to a power of two
    heads = kv_head * GROUP + group_rows

    q_offsets = row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_is_head[:, None], other=0.0).to(tl.float32) * scale
    context_len = tl.load(context_lens_ptr + row)
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for index in range(0, num_blocks):
        block = tl.load(block_tables_ptr + row * stride_table_row + index).to(tl.int64)
        in_context = index * BLOCK_SIZE + block_offsets < context_len
        slots = block * BLOCK_SIZE + block_offsets
        kv_offsets = kv_head * stride_cache_head + slots[:, None] * stride_cache_slot + dims[None, :]
        keys = tl.load(keys_ptr + kv_offsets, mask=in_context[:, None], other=0.0).to(tl.float32)
        values = tl.load(values_ptr + kv_offsets, mask=in_context[:, None], other=0.0).to(tl.float32)
        if QUANTIZED:
            keys = keys * tl.load(key_scales_ptr + kv_head * stride_scales_head + block)
            values = values * tl.load(value_scales_ptr + kv_head * stride_scales_head + block)
        # Broadcast-and-sum instead of tl.dot: a GQA group has a handful of rows, below tl.dot's
        # 16-row minimum, and decode is bound by reading K/V, not by these multiplies.
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_SIZE]
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.sum(probs[:, :, None] * values[None, :, :], axis=1)
        running_max = new_max
    out = acc / running_sum[:, None]
    out_offsets = row * stride_out_row + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_is_head[:, None])


def interpreter_enabled() -> bool:
    return INTERPRETED


def shape_supported(head_dim: int, block_size: int) -> bool:
    """tl.arange needs power-of-two lengths; other shapes use the torch fallback."""
    return triton.next_power_of_2(head_dim) == head_dim and triton.next_power_of_2(block_size) == block_size


def paged_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_scales: torch.Tensor | None,
    value_scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D]; keys/values [KVH, slots, D] (int8 with [KVH, blocks] scales, or the q dtype);
    block_tables [B, >= ceil(len / block_size)]; context_lens [B] -> out [B, H, D] in q's dtype."""
    batch, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or keys.stride(2) != 1 or values.stride() != keys.stride():
        raise ValueError("paged_decode_attention needs head_dim-contiguous q and identically laid out K/V")
    num_kv_heads = keys.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    quantized = key_scales is not None
    # Unused pointers still need a tensor: the keys stand in for absent scales.
    key_scales_arg = key_scales if quantized else keys
    value_scales_arg = value_scales if quantized else keys
    _paged_decode_kernel[(batch, num_kv_heads)](
        out,
        q,
        keys,
        values,
        key_scales_arg,
        value_scales_arg,
        block_tables,
        context_lens,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        keys.stride(0),
        keys.stride(1),
        key_scales_arg.stride(0),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        QUANTIZED=quantized,
    )
    return out
