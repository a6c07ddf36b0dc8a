"""Paged attention backends and the seam where device-specific kernels plug in.

Every backend receives the step's flat q/k/v ([num_tokens, heads, head_dim]), writes the new K/V
into the paged cache, and returns the attention output for every token. What it needs to know
about the batch (which rows belong to which sequence, the slots of each context) is computed once
per step by the model runner into `AttentionMetadata`, so per-layer work stays small.

Backends:
- `reference`: one sequence at a time, gather the context's blocks, torch SDPA with an explicit
  causal mask. Slow but obviously right; the other backends are tested against it.
- `cpu_batched`: all decode rows in one batched GQA matmul over a padded gather (no per-sequence
  Python work per layer), prefill chunks through SDPA. The fastest on CPU, and the CPU default.
- `cuda` (backend/model/attention_cuda.py, CUDA devices only): prefill chunks through torch's fused SDPA,
  decodes through a Triton paged-attention kernel reading K/V via the block tables.
Each backend names the device types it runs on; `create_backend` refuses any other at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ctxgate.backend.model.kv_cache import KVCache, KVWritePlan


@dataclass
class PrefillChunk:
    """One sequence with more than one new token this step."""

    row_start: int  # first row in the flat token batch
    row_end: int
    context_blocks: torch.Tensor  # [ceil(context_len / block_size)] blocks of the chunk's context
    context_len: int
    # [query_len, context_len] boolean (True = attend), None when the chunk is the whole context
    # so plain causal attention applies.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    write_plan: KVWritePlan
    num_decodes: int  # decode rows are the first `num_decodes` rows of the batch
    # [num_decodes, max_blocks] block tables padded to a common length (padding reads block 0)
    decode_blocks: torch.Tensor | None
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64
    decode_bias: torch.Tensor | None  # [1, num_decodes, 1, max_context] additive mask, None if unpadded
    prefills: list[PrefillChunk]
    # Raw per-sequence facts for backends (e.g. CUDA kernels) that want them.
    query_start: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)


class AttentionBackend:
    name = "base"
    # True when a decode-only step has static shapes and no host sync (CUDA graph capture).
    supports_decode_graphs = False
    # True when a CPU decode-only step over static buffers needs no per-step mask (a traced step).
    supports_traced_decode = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        raise NotImplementedError


class PagedAttentionBackend(AttentionBackend):
    """A backend that writes the step's K/V, runs all decode rows in one call and each prefill
    chunk on its own; subclasses say how (`decode`, `prefill`)."""

    def forward(self, layer, q, k, v, kv_cache, metadata):
        kv_cache.write(layer, k, v, metadata.write_plan)
        num_decodes = metadata.num_decodes
        if num_decodes == q.shape[0] and not metadata.prefills:
            return self.decode(layer, q, kv_cache, metadata)
        out = torch.empty_like(q)
        if num_decodes:
            out[:num_decodes] = self.decode(layer, q[:num_decodes], kv_cache, metadata)
        for chunk in metadata.prefills:
            rows = slice(chunk.row_start, chunk.row_end)
            out[rows] = self.prefill(layer, q[rows], k[rows], v[rows], kv_cache, chunk)
        return out

    def decode(
        self, layer: int, q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """q [num_decodes, H, D] (one new token per sequence) -> [num_decodes, H, D]."""
        raise NotImplementedError

    def prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        """One chunk's q/k/v [chunk_len, heads, D] -> [chunk_len, H, D]."""
        raise NotImplementedError


def _causal_sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [Lq, H, D], keys/values [KVH, Lk, D] -> [Lq, H, D]; GQA via enable_gqa."""
    q_t = q.transpose(0, 1).unsqueeze(0)
    k_t = keys.unsqueeze(0)
    v_t = values.unsqueeze(0)
    if mask is None:
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


class ReferenceAttention(AttentionBackend):
    """Sequence by sequence: gather blocks, repeat KV heads, SDPA with an explicit causal mask."""

    name = "reference"

    def forward(self, layer, q, k, v, kv_cache, metadata):
        kv_cache.write(layer, k, v, metadata.write_plan)
        out = torch.empty_like(q)
        block_size = kv_cache.spec.block_size
        for start, query_len, context_len, table in zip(
            metadata.query_start,
            metadata.query_lens,
            metadata.context_lens,
            metadata.block_tables,
            strict=True,
        ):
            positions = torch.arange(context_len, device=q.device)
            blocks = torch.tensor(table, dtype=torch.long, device=q.device)
            slots = blocks[positions // block_size] * block_size + positions % block_size
            keys, values = kv_cache.gather(layer, slots)
            keys = keys.repeat_interleave(self.group_size, dim=0)  # [H, L, D]
            values = values.repeat_interleave(self.group_size, dim=0)
            query_positions = torch.arange(context_len - query_len, context_len, device=q.device)
            mask = positions.unsqueeze(0) <= query_positions.unsqueeze(1)
            out[start : start + query_len] = F.scaled_dot_product_attention(
                q[start : start + query_len].transpose(0, 1),
                keys,
                values,
                attn_mask=mask,
                scale=self.scale,
            ).transpose(0, 1)
        return out


_NO_SCALES = torch.empty(0)


class CPUBatchedAttention(PagedAttentionBackend):
    """Decodes batched in one GQA matmul over a padded gather; prefill chunks through SDPA.

    With the C++ kernels loaded (backend/model/cpu_kernels.py), bfloat16 and int8 decodes read K/V
    straight from the paged pool instead (no gathered copy per layer).
    """

    name = "cpu_batched"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(num_heads, num_kv_heads, head_dim)
        from ctxgate.backend.model import cpu_kernels

        self.use_kernel = cpu_kernels.load()
        # The kernel masks each row by its context length; the gathered path needs a per-step bias.
        self.supports_traced_decode = self.use_kernel

    def prefill(self, layer, q, k, v, kv_cache, chunk):
        if chunk.mask is None:
            # The chunk is the sequence's whole context: attend to the fresh K/V directly.
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            keys, values = kv_cache.gather_blocks(layer, chunk.context_blocks)
            keys, values = keys[:, : chunk.context_len], values[:, : chunk.context_len]
        return _causal_sdpa(q, keys, values, chunk.mask, self.scale)

    def decode(self, layer: int, q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata):
        assert metadata.decode_blocks is not None and metadata.decode_context_lens is not None
        # The C++ kernel reads CPU memory only: a backend picked for CUDA tensors never calls it.
        on_cpu = q.device.type == "cpu"
        if self.use_kernel and on_cpu and kv_cache.keys[layer].dtype in (torch.bfloat16, torch.int8):
            quantized = kv_cache.quantized
            return torch.ops.ctxgate_cpu.paged_decode_attention(
                q,
                kv_cache.keys[layer],
                kv_cache.values[layer],
                kv_cache.key_scales[layer] if quantized else _NO_SCALES,
                kv_cache.value_scales[layer] if quantized else _NO_SCALES,
                metadata.decode_blocks,
                metadata.decode_context_lens,
                kv_cache.spec.block_size,
                self.scale,
            )
        return gathered_decode_attention(
            q, kv_cache, layer, metadata.decode_blocks, metadata.decode_bias, self.num_kv_heads, self.scale
        )


def gathered_decode_attention(
    q: torch.Tensor,
    kv_cache: KVCache,
    layer: int,
    block_tables: torch.Tensor,
    bias: torch.Tensor | None,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """Decode rows q [B, H, D] over a gathered copy of their blocks ([B, max_blocks] tables); `bias`
    ([1, B, 1, max_blocks * block_size], -inf past each context) masks the padding."""
    batch, max_blocks = block_tables.shape
    _, num_heads, head_dim = q.shape
    group_size = num_heads // num_kv_heads
    max_context = max_blocks * kv_cache.spec.block_size
    keys, values = kv_cache.gather_blocks(layer, block_tables.view(-1))  # [KVH, B*L, D]
    keys = keys.view(num_kv_heads, batch, max_context, head_dim)
    values = values.view(num_kv_heads, batch, max_context, head_dim)
    # Batch over (kv head, sequence) with the query heads of a group as rows: every operand is
    # contiguous, so no K/V copy beyond the gather (strided batched matmuls were ~5x slower).
    query = q.view(batch, num_kv_heads, group_size, head_dim).transpose(0, 1)
    scores = torch.matmul(query, keys.transpose(-1, -2)).float().mul_(scale)  # [KVH, B, G, L]
    if bias is not None:
        scores.add_(bias)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [KVH, B, G, D]
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim)


def _cuda_backend(num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    # Imported on use: the CUDA module pulls in Triton lazily and is no business of the CPU engine.
    from ctxgate.backend.model.attention_cuda import CUDAAttention

    return CUDAAttention(num_heads, num_kv_heads, head_dim)


BackendFactory = Callable[[int, int, int], AttentionBackend]
ANY_DEVICE = ("cpu", "cuda")
# name -> (factory, device types it runs on)
_BACKENDS: dict[str, tuple[BackendFactory, tuple[str, ...]]] = {
    ReferenceAttention.name: (ReferenceAttention, ANY_DEVICE),
    CPUBatchedAttention.name: (CPUBatchedAttention, ANY_DEVICE),  # on CUDA: the gathered path only
    "cuda": (_cuda_backend, ("cuda",)),
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def backend_devices(name: str) -> tuple[str, ...]:
    return _BACKENDS[name][1]


def default_backend_name(device: torch.device) -> str:
    if device.type == "cuda":
        return "cuda"
    return CPUBatchedAttention.name


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The backend `name` stands for on `device`; a clear error if it does not exist or run there."""
    if name == "auto":
        name = default_backend_name(device)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(available_backends())}")
    devices = backend_devices(name)
    if device.type not in devices:
        raise ValueError(
            f"attention backend {name!r} runs on {' or '.join(devices)} devices only, and this engine runs "
            f"on {device}; choose another --attention-backend or --device"
        )
    return name


def create_backend(
    name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    factory, _ = _BACKENDS[resolve_backend_name(name, device)]
    return factory(num_heads, num_kv_heads, head_dim)
