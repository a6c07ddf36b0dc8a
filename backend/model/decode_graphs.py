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

On a CPU the same buffers serve traced decode steps (`trace=True`): each size's forward is recorded
once with `torch.jit.trace` and replayed by TorchScript's interpreter in C++. The eager step makes
~400 Python-level op calls, each of which releases the GIL and must take it back; beside a busy
Python thread (the gateway's compression) each take-back can wait a whole switch interval. The
traced step runs its ops without returning to Python (docs/decisions/traced-decode-steps.md).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ctxgate.backend.model.attention import AttentionBackend, AttentionMetadata
from ctxgate.backend.model.kv_cache import KVCache, KVCacheSpec
from ctxgate.backend.model.llama import LlamaModel

logger = logging.getLogger(__name__)

CAPTURE_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# Traced CPU decode steps run every matmul through the C++ GEMV, which streams the weights once
# for all rows; beyond this many rows oneDNN's GEMM is the faster path and the step runs eagerly.
TRACED_DECODE_MAX_BATCH = 8


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
        self,
        max_batch: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
    ):
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full(
            (max_batch,), scratch_block * block_size, dtype=torch.long, device=device
        )
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
            raise ValueError(
                f"cannot pad a batch of {rows} rows to {padded_size} (buffers hold {self.max_batch})"
            )
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
            raise ValueError(
                f"a block table of {width} blocks exceeds the {self.max_blocks_per_seq} per sequence"
            )
        tables = [table + [self.scratch_block] * (width - len(table)) for table in batch.block_tables]
        tables += [[self.scratch_block] * width] * padding
        self.block_tables[:padded_size, :width].copy_(
            torch.tensor(tables, dtype=torch.long), non_blocking=True
        )

    @staticmethod
    def _copy(buffer: torch.Tensor, values: list[int]) -> None:
        buffer[: len(values)].copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)

    def metadata(self, size: int, kv_cache: KVCache) -> AttentionMetadata:
        """Attention metadata over the first `size` rows (views of the buffers: static addresses)."""
        return static_decode_metadata(
            kv_cache, self.slot_mapping[:size], self.context_lens[:size], self.block_tables[:size]
        )

    def step_inputs(self, size: int) -> tuple[torch.Tensor, ...]:
        """The first `size` rows of every buffer, in `DecodeGraphs.forward_from`'s argument order."""
        return (
            self.input_ids[:size],
            self.positions[:size],
            self.slot_mapping[:size],
            self.context_lens[:size],
            self.block_tables[:size],
            self.logits_rows[:size],
        )


def static_decode_metadata(
    kv_cache: KVCache, slot_mapping: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor
) -> AttentionMetadata:
    return AttentionMetadata(
        write_plan=kv_cache.make_write_plan(slot_mapping),
        num_decodes=slot_mapping.shape[0],
        decode_blocks=block_tables,
        decode_context_lens=context_lens,
        decode_bias=None,  # static-shape backends mask from decode_context_lens
        prefills=[],
    )


def untraceable_reason(model: LlamaModel, kv_spec: KVCacheSpec) -> str | None:
    """Why this model's decode step cannot be traced on a CPU; None when it can."""
    if kv_spec.quantized or kv_spec.dtype != torch.bfloat16:
        return "traced decode steps need a bfloat16 KV cache (the C++ paged-attention kernel)"
    for linear in model.linears():
        if not linear.gemv_max_rows:
            return (
                "a matmul has no C++ GEMV (the CPU kernels are not loaded, or the weights are not bfloat16)"
            )
    return None


def _as_recorded() -> contextlib.AbstractContextManager[None]:
    """TorchScript runs a traced step as recorded, without its graph optimizations: they cost
    seconds of start-up per batch size and made the step slower, not faster."""
    return torch.jit.optimized_execution(False)


class DecodeGraphs:
    """Runs decode-only steps padded to `sizes`, replaying one captured CUDA graph (or, on a CPU,
    one traced TorchScript function) per size."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        attention: AttentionBackend,
        buffers: DecodeInputBuffers,
        sizes: tuple[int, ...],
        capture: bool,
        trace: bool = False,
    ):
        if trace and capture:
            raise ValueError("decode steps are either captured (CUDA) or traced (CPU), not both")
        static = attention.supports_traced_decode if trace else attention.supports_decode_graphs
        if not static:
            raise ValueError(f"attention backend {attention.name!r} cannot run static-shape decode steps")
        if kv_cache.quantized:
            raise ValueError(
                "decode graphs need a 16/32-bit KV cache: int8 writes have data-dependent shapes"
            )
        reason = untraceable_reason(model, kv_cache.spec) if trace else None
        if reason is not None:
            raise ValueError(reason)
        if max(sizes) > buffers.max_batch:
            raise ValueError(
                f"buffers hold {buffers.max_batch} rows, fewer than the largest size {max(sizes)}"
            )
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.buffers = buffers
        self.sizes = tuple(sorted(sizes))
        self.capture = capture
        self.trace = trace
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.traced: dict[int, torch.jit.ScriptFunction] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _forward(self, size: int) -> torch.Tensor:
        return self.forward_from(*self.buffers.step_inputs(size))

    def forward_from(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """The padded decode forward over these buffer views (what a trace records)."""
        metadata = static_decode_metadata(self.kv_cache, slot_mapping, context_lens, block_tables)
        return self.model(input_ids, positions, self.attention, self.kv_cache, metadata, logits_rows)

    def capture_all(self) -> None:
        """Record one graph per size, largest first so the smaller ones reuse its memory pool."""
        if self.trace:
            self.trace_all()
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

    def trace_all(self) -> None:
        """Trace one function per size over padding rows. The buffers are its inputs, the weights
        and the KV pool its constants (the same storage: its K/V writes land in the pool)."""
        for size in self.sizes:
            self.buffers.fill(DecodeBatch([], [], [], [], []), size)
            inputs = self.buffers.step_inputs(size)
            with self._traceable(size), warnings.catch_warnings(), torch.inference_mode(), _as_recorded():
                # The tracer warns about every Python int it freezes (sizes, the decode-only branch):
                # all fixed for a padded size by construction.
                warnings.simplefilter("ignore")
                traced = torch.jit.trace(self.forward_from, inputs, check_trace=False)
                traced(*inputs)  # the executor builds its plan on the first run
            self.traced[size] = traced
        logger.info("traced CPU decode steps for batch sizes %s", ", ".join(map(str, self.sizes)))

    @contextlib.contextmanager
    def _traceable(self, size: int) -> Iterator[None]:
        """While tracing: no side work between layers (a trace cannot call back into Python), and
        every C++ GEMV takes `size` rows (oneDNN's packed matmul has an argument the tracer cannot record)."""
        model = self.model
        between, model.between_layers = model.between_layers, None
        linears = [linear for linear in model.linears() if linear.gemv_max_rows]
        saved = [linear.gemv_max_rows for linear in linears]
        for linear in linears:
            linear.gemv_max_rows = max(linear.gemv_max_rows, size)
        try:
            yield
        finally:
            model.between_layers = between
            for linear, rows in zip(linears, saved, strict=True):
                linear.gemv_max_rows = rows

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
        elif size in self.traced:
            with torch.inference_mode(), _as_recorded():
                logits = self.traced[size](*self.buffers.step_inputs(size))
        else:
            logits = self._forward(size)
        return logits[: len(batch)]
