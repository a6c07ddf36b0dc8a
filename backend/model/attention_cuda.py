"""The CUDA attention backend: fused SDPA for prefill chunks, paged decode through the block tables.

- Prefill: each chunk attends to its own fresh K/V (a whole-context chunk: plain causal SDPA) or
  to its cached prefix plus itself (the chunk's rows see every earlier position: a lower-right
  causal bias, which torch dispatches to the flash / memory-efficient kernels instead of
  materialising a mask).
- Decode: the Triton kernel in backend/model/triton_paged_attention.py reads each row's K/V through its
  block table, no gathered copy per step. Triton is imported when the backend is built, so the CPU
  engine never needs it; without Triton (or for shapes it does not take) decodes fall back to a
  gathered batched matmul.

Decode takes only `decode_blocks` and `decode_context_lens` from the metadata and builds its mask
(fallback) on the device, so a decode step has static shapes and no host sync: what CUDA graph
capture (backend/model/decode_graphs.py) needs.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ctxgate.backend.model.attention import (
    AttentionMetadata,
    PagedAttentionBackend,
    PrefillChunk,
    gathered_decode_attention,
)
from ctxgate.backend.model.kv_cache import KVCache

logger = logging.getLogger(__name__)

DECODE_KERNELS = ("auto", "triton", "torch")


def load_triton_kernels() -> ModuleType | None:
    """ctxgate.backend.model.triton_paged_attention, or None where triton is not installed."""
    try:
        from ctxgate.backend.model import triton_paged_attention
    except ImportError as exc:
        logger.warning("triton is not importable (%s): CUDA decodes use the gathered torch path", exc)
        return None
    return triton_paged_attention


class CUDAAttention(PagedAttentionBackend):
    name = "cuda"
    supports_decode_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, decode_kernel: str = "auto"):
        """decode_kernel: auto (Triton where it runs), triton (required), torch (the gathered path)."""
        super().__init__(num_heads, num_kv_heads, head_dim)
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, not {decode_kernel!r}")
        self.triton = None if decode_kernel == "torch" else load_triton_kernels()
        if decode_kernel == "triton" and self.triton is None:
            raise RuntimeError(
                "decode_kernel='triton' but triton is not installed (pip install 'ctxgate[gpu]')"
            )

    def decode_kernel_for(self, q: torch.Tensor, block_size: int) -> str:
        """Which decode path runs for these tensors: the Triton kernel runs on CUDA tensors, or on
        CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, for tests)."""
        if self.triton is None or not self.triton.shape_supported(self.head_dim, block_size):
            return "torch"
        if q.is_cuda or self.triton.interpreter_enabled():
            return "triton"
        return "torch"

    def prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        """q/k/v [chunk_len, heads, D] -> [chunk_len, H, D]."""
        query = q.transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        if chunk.mask is None:  # the chunk is the whole context
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            keys, values = kv_cache.gather_blocks(layer, chunk.context_blocks)
            keys = keys[:, : chunk.context_len].unsqueeze(0)
            values = values[:, : chunk.context_len].unsqueeze(0)
            bias = causal_lower_right(q.shape[0], chunk.context_len)
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=bias, scale=self.scale, enable_gqa=True
            )
        return out.squeeze(0).transpose(0, 1)

    def decode(
        self, layer: int, q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        blocks, lengths = metadata.decode_blocks, metadata.decode_context_lens
        assert blocks is not None and lengths is not None
        block_size = kv_cache.spec.block_size
        if self.decode_kernel_for(q, block_size) == "triton":
            assert self.triton is not None
            quantized = kv_cache.quantized
            return self.triton.paged_decode_attention(
                q,
                kv_cache.keys[layer],
                kv_cache.values[layer],
                kv_cache.key_scales[layer] if quantized else None,
                kv_cache.value_scales[layer] if quantized else None,
                blocks,
                lengths,
                block_size,
                self.scale,
            )
        return gathered_decode_attention(
            q,
            kv_cache,
            layer,
            blocks,
            padding_bias(lengths, blocks.shape[1] * block_size),
            self.num_kv_heads,
            self.scale,
        )


def padding_bias(context_lens: torch.Tensor, max_context: int) -> torch.Tensor:
    """[1, B, 1, max_context] additive mask, -inf past each row's context, built on the device from
    the lengths (no host values: a captured graph replays it for new lengths)."""
    positions = torch.arange(max_context, device=context_lens.device)
    padding = positions.unsqueeze(0) >= context_lens.unsqueeze(1)
    bias = torch.zeros(padding.shape, dtype=torch.float32, device=context_lens.device)
    bias.masked_fill_(padding, float("-inf"))
    return bias.view(1, context_lens.shape[0], 1, max_context)
