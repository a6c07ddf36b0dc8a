"""Decode steps at a few fixed batch sizes: static input buffers, padded batches, CUDA graph replay.

A decode step launches hundreds of small kernels (a few per layer); on a GPU the launch overhead,
not the arithmetic, bounds a small model's decode. A CUDA graph records the whole forward once per
batch size and replays it with one launch. A graph reads fixed addresses, so each step's inputs
are copied into static buffers, and a batch is padded up to the next captured size.

Padding rows are harmless by construction: they write their K/V into a scratch block that the
block manager never hands out (the pool is allocated one block larger), attend to that one slot
(context length 1), and their logits are dropped.

Everything but capture and replay is device-independent: with `capture=False` the same padded,
static-buffer forward runs eagerly, which is how the CPU tests check it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from backend.attention import AttentionBackend, AttentionMetadata
from backend.kv_cache import KVCache
from backend.model import LlamaModel

logger = logging.getLogger(__name__)

CAPTURE_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def capture_sizes(max_num_seqs: int, sizes: tuple[int, ...] = CAPTURE_BATCH_SIZES) -> tuple[int, ...]:
    """The sizes worth capturing: every standard size up to the first one that holds max_num_seqs."""
    chosen = [size for size in sorted(sizes) if size < max_num_seqs]
    larger = [size for size in sorted(sizes) if size >= max_num_seqs]
    return tuple(chosen + larger[:1])


def padded_batch_size(num_rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size holding `num_rows`; None when the batch is larger than all."""
    return next((size for size in sorted(sizes) if size >= num_rows), None)


@dataclass
class DecodeBatch:
    """One decode step's inputs, one entry per row (host lists, unpadded)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


class DecodeInputBuffers:
    """The static tensors a captured decode graph reads; `fill` copies a step's inputs in, padded."""

    def __init__(
        self, max_batch: int, max_blocks_per_seq: int, scratch_block: int, block_size: int, device: torch.device
    ):
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), scratch_block * block_size, dtype=torch.long, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.long, device=device)
        self.block_tables = torch.full(
            (max_batch, max_blocks_per_seq), scratch_block, dtype=torch.long, device=device
        )
        self.logits_rows = torch.arange(max_batch, dtype=torch.long, device=device)

    @property
    def max_batch(self) -> int:
        return self.input_ids.shape[0]

    def fill(self, batch: DecodeBatch, padded_size: int) -> None:
        """Copy `batch` into rows [0, len) and make rows [len, padded_size) padding rows."""
        rows = len(batch)
        if not rows <= padded_size <= self.max_batch:
            raise ValueError(f"cannot pad a batch of {rows} rows to {padded_size} (buffers hold {self.max_batch})")
        padding = padded_size - rows
        scratch_slot = self.scratch_block * self.block_size
        self._copy(self.input_ids, batch.input_ids + [0] * padding)
        self._copy(self.positions, batch.positions + [0] * padding)
        self._copy(self.slot_mapping, batch.slot_mapping + [scratch_slot] * padding)
        self._copy(self.context_lens, batch.context_lens + [1] * padding)
        # Only the columns the longest table uses are copied: a row never reads past its own
        # context, and stale columns beyond hold block ids that are still valid to address.
        width = max((len(table) for table in batch.block_tables), default=1)
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {width} blocks exceeds the {self.max_blocks_per_seq} per sequence")
        tables = [table + [self.scratch_block] * (width - len(table)) for table in batch.block_tables]
        tables += [[self.scratch_block] * width] * padding
        self.block_tables[:padded_size, :width].copy_(torch.tensor(tables, dtype=torch.long), non_blocking=True)

    @staticmethod
    def _copy(buffer: torch.Tensor, values: list[int]) -> None:
        buffer[: len(values)].copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)

    def metadata(self, size: int, kv_cache: KVCache) -> AttentionMetadata:
        """Attention metadata over the first `size` rows (views of the buffers: static addresses)."""
        return AttentionMetadata(
            write_plan=kv_cache.make_write_plan(self.slot_mapping[:size]),
            num_decodes=size,
            decode_blocks=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size],
            decode_bias=None,  # graph-capable backends mask from decode_context_lens on the device
            prefills=[],
        )


class DecodeGraphs:
    """Runs decode-only steps padded to `sizes`, replaying one captured CUDA graph per size."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        attention: AttentionBackend,
        buffers: DecodeInputBuffers,
        sizes: tuple[int, ...],
        capture: bool,
    ):
        if not attention.supports_decode_graphs:
            raise ValueError(f"attention backend {attention.name!r} cannot run static-shape decode steps")
        if kv_cache.quantized:
            raise ValueError("decode graphs need a 16/32-bit KV cache: int8 writes have data-dependent shapes")
        if max(sizes) > buffers.max_batch:
            raise ValueError(f"buffers hold {buffers.max_batch} rows, fewer than the largest size {max(sizes)}")
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.buffers = buffers
        self.sizes = tuple(sorted(sizes))
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _forward(self, size: int) -> torch.Tensor:
        buffers = self.buffers
        return self.model(
            buffers.input_ids[:size],
            buffers.positions[:size],
            self.attention,
            self.kv_cache,
            buffers.metadata(size, self.kv_cache),
            buffers.logits_rows[:size],
        )

    def capture_all(self) -> None:
        """Record one graph per size, largest first so the smaller ones reuse its memory pool."""
        if not self.capture:
            return
        pool = None
        for size in reversed(self.sizes):
            self.buffers.fill(DecodeBatch([], [], [], [], []), size)  # every row a padding row
            self._forward(size)  # warm-up: Triton compiles, cuBLAS picks its kernels outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", ", ".join(map(str, self.sizes)))

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Float32 logits [len(batch), vocab]. With graphs this is a view of the graph's output
        buffer, valid until the next `run`: sample from it before stepping again."""
        size = padded_batch_size(len(batch), self.sizes)
        if size is None:
            raise ValueError(f"a decode batch of {len(batch)} rows exceeds the largest size {self.max_batch}")
        self.buffers.fill(batch, size)
        if size in self.graphs:
            self.graphs[size].replay()
            logits = self.outputs[size]
        else:
            logits = self._forward(size)
        return logits[: len(batch)]

