"""Per-layer paged KV pools.

Each layer owns one key and one value tensor shaped [num_kv_heads, num_blocks * block_size,
head_dim]; a token's KV lives at its *slot* (block_id * block_size + offset). Writes are in place
(`index_copy_` at the step's slot mapping); readers gather the slots of a sequence. Heads come
first so a gather yields [heads, tokens, head_dim], the layout attention matmuls consume without
another copy.

int8 mode stores K/V as int8 with one float32 scale per (block, kv head). A block fills up over
several steps, so its scale can only grow: when new tokens need a larger scale the block's
existing int8 values are rescaled to it. Values are dequantized when attention gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127.0


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model (compute) dtype
    quantized: bool  # int8 storage

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8 if self.quantized else self.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V data per token over all layers (int8 scales are per block, not counted)."""
        # dtype.itemsize, not a tensor's element_size(): the engine's stats read this every step.
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.storage_dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        scales = 2 * self.num_layers * self.num_kv_heads * 4 if self.quantized else 0
        return self.block_size * self.kv_bytes_per_token + scales

    def blocks_for_memory(self, memory_mb: float) -> int:
        return max(1, int(memory_mb * 1024 * 1024) // self.bytes_per_block)


def kv_blocks_for_gpu_memory(
    free_bytes: int, total_bytes: int, utilization: float, bytes_per_block: int, reserve_bytes: int = 0
) -> int:
    """KV blocks that fit in a GPU, vLLM's rule: the engine may hold `utilization` of the total
    memory; what is in use now (this process's weights and other processes alike) and the
    activation reserve come off that budget, and the pool gets the rest."""
    in_use = total_bytes - free_bytes
    budget = int(total_bytes * utilization) - in_use - reserve_bytes
    if budget < bytes_per_block:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {total_bytes * utilization / gib:.1f} GiB, but "
            f"{in_use / gib:.1f} GiB are in use and {reserve_bytes / gib:.1f} GiB are kept for activations: "
            "no room for the KV cache; raise --gpu-memory-utilization or free GPU memory"
        )
    return budget // bytes_per_block


def activation_reserve_bytes(
    hidden_size: int,
    intermediate_size: int,
    qkv_size: int,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype_bytes: int,
    slack_bytes: int = 512 * 2**20,
) -> int:
    """GPU memory kept out of the KV pool for one step's activations (upper estimate).

    Per scheduled token a layer holds a few hidden-sized tensors, the fused QKV and attention
    outputs and the gate/up (2x intermediate) and SiLU products; float32 logits (and the sampler's
    copies) per sequence; and fixed slack for the CUDA context's allocations, cuBLAS workspaces,
    CUDA-graph pools and allocator fragmentation.
    """
    per_token = (4 * hidden_size + 2 * qkv_size + 3 * intermediate_size) * dtype_bytes
    logits = 3 * max_num_seqs * vocab_size * 4
    return max_num_batched_tokens * per_token + logits + slack_bytes


@dataclass
class KVWritePlan:
    """Per-step indices for writing the new tokens' KV, computed once and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] slot of each new token
    # int8 only: the distinct blocks written this step, each token's index into them, and which
    # blocks start fresh this step (their old scale belongs to a previous owner).
    written_blocks: torch.Tensor | None = None
    token_block_index: torch.Tensor | None = None
    fresh_blocks: torch.Tensor | None = None


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = device
        num_slots = num_blocks * spec.block_size
        shape = (spec.num_kv_heads, num_slots, spec.head_dim)
        self.keys = [
            torch.zeros(shape, dtype=spec.storage_dtype, device=device) for _ in range(spec.num_layers)
        ]
        self.values = [
            torch.zeros(shape, dtype=spec.storage_dtype, device=device) for _ in range(spec.num_layers)
        ]
        if spec.quantized:
            scale_shape = (spec.num_kv_heads, num_blocks)
            self.key_scales = [torch.zeros(scale_shape, device=device) for _ in range(spec.num_layers)]
            self.value_scales = [torch.zeros(scale_shape, device=device) for _ in range(spec.num_layers)]

    @property
    def quantized(self) -> bool:
        return self.spec.quantized

    def make_write_plan(self, slot_mapping: torch.Tensor) -> KVWritePlan:
        if not self.quantized:
            return KVWritePlan(slot_mapping=slot_mapping)
        block_ids = torch.div(slot_mapping, self.spec.block_size, rounding_mode="floor")
        written_blocks, token_block_index = torch.unique(block_ids, return_inverse=True)
        offsets = slot_mapping % self.spec.block_size
        fresh = torch.zeros(written_blocks.shape[0], dtype=torch.bool, device=slot_mapping.device)
        fresh.index_fill_(0, token_block_index[offsets == 0], True)
        return KVWritePlan(slot_mapping, written_blocks, token_block_index, fresh)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, plan: KVWritePlan) -> None:
        """Store the step's new K/V ([num_tokens, kv_heads, head_dim]) at their slots."""
        if not self.quantized:
            self.keys[layer].index_copy_(1, plan.slot_mapping, key.transpose(0, 1))
            self.values[layer].index_copy_(1, plan.slot_mapping, value.transpose(0, 1))
            return
        self._write_int8(self.keys[layer], self.key_scales[layer], key.transpose(0, 1), plan)
        self._write_int8(self.values[layer], self.value_scales[layer], value.transpose(0, 1), plan)

    def _write_int8(
        self, cache: torch.Tensor, scales: torch.Tensor, new: torch.Tensor, plan: KVWritePlan
    ) -> None:
        """new: [kv_heads, num_tokens, head_dim]; scales: [kv_heads, num_blocks]."""
        assert plan.written_blocks is not None and plan.token_block_index is not None
        assert plan.fresh_blocks is not None
        spec = self.spec
        heads = spec.num_kv_heads
        num_written = plan.written_blocks.shape[0]
        token_amax = new.abs().amax(dim=-1).float()  # [kv_heads, num_tokens]
        block_amax = torch.zeros(heads, num_written, device=new.device)
        index = plan.token_block_index.unsqueeze(0).expand(heads, -1)
        block_amax.scatter_reduce_(1, index, token_amax, reduce="amax")
        old_scales = scales.index_select(1, plan.written_blocks)
        old_scales = old_scales.masked_fill(plan.fresh_blocks.unsqueeze(0), 0.0)
        new_scales = torch.maximum(old_scales, block_amax / INT8_MAX).clamp_min(1e-8)
        # Rescale what the written blocks already hold to their (possibly larger) new scale.
        blocks = cache.view(heads, self.num_blocks, spec.block_size, spec.head_dim)
        ratio = (old_scales / new_scales).view(heads, num_written, 1, 1)
        existing = blocks.index_select(1, plan.written_blocks).float() * ratio
        blocks.index_copy_(1, plan.written_blocks, existing.round_().to(torch.int8))
        scales.index_copy_(1, plan.written_blocks, new_scales)
        token_scales = new_scales.index_select(1, plan.token_block_index).unsqueeze(-1)
        quantized = (new.float() / token_scales).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        cache.index_copy_(1, plan.slot_mapping, quantized)

    def gather_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, [kv_heads, len(block_ids) * block_size, head_dim], compute dtype.

        Copying whole blocks moves block_size * head_dim contiguous values per index, several times
        faster than a per-slot gather for decode batches.
        """
        spec = self.spec
        heads, block_size, head_dim = spec.num_kv_heads, spec.block_size, spec.head_dim
        num_gathered = block_ids.shape[0]
        keys = self.keys[layer].view(heads, self.num_blocks, block_size * head_dim).index_select(1, block_ids)
        values = (
            self.values[layer].view(heads, self.num_blocks, block_size * head_dim).index_select(1, block_ids)
        )
        if self.quantized:
            dtype = spec.dtype
            key_scales = self.key_scales[layer].index_select(1, block_ids).unsqueeze(-1).to(dtype)
            value_scales = self.value_scales[layer].index_select(1, block_ids).unsqueeze(-1).to(dtype)
            keys = keys.to(dtype) * key_scales
            values = values.to(dtype) * value_scales
        shape = (heads, num_gathered * block_size, head_dim)
        return keys.view(shape), values.view(shape)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at 1-D `slots` as [kv_heads, len(slots), head_dim] in the compute dtype."""
        # index_select is several times faster than advanced indexing for this gather.
        keys = self.keys[layer].index_select(1, slots)
        values = self.values[layer].index_select(1, slots)
        if not self.quantized:
            return keys, values
        block_ids = torch.div(slots, self.spec.block_size, rounding_mode="floor")
        key_scales = self.key_scales[layer].index_select(1, block_ids).unsqueeze(-1)
        value_scales = self.value_scales[layer].index_select(1, block_ids).unsqueeze(-1)
        dtype = self.spec.dtype
        return (keys.to(dtype) * key_scales.to(dtype)), (values.to(dtype) * value_scales.to(dtype))
