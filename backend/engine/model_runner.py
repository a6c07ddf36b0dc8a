"""Turns a scheduler step into one batched forward pass.

All index tensors (positions, slot mapping, gather slots, masks) are built here once per step, so
the per-layer work in the model and attention backend does not grow with Python-side bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxgate.backend.engine.scheduler import ScheduledSequence
from ctxgate.backend.engine.sequence import Sequence
from ctxgate.backend.model.attention import AttentionBackend, AttentionMetadata, PrefillChunk
from ctxgate.backend.model.decode_graphs import DecodeBatch, DecodeGraphs
from ctxgate.backend.model.kv_cache import KVCache
from ctxgate.backend.model.llama import LlamaModel

DECODE_CONTEXT_BUCKET = 64


@dataclass
class ModelRunnerOutput:
    sampled_sequences: list[Sequence]  # in the row order of `logits`
    logits: torch.Tensor  # [len(sampled_sequences), vocab] float32


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        attention: AttentionBackend,
        device: torch.device,
        decode_graphs: DecodeGraphs | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = device
        self.block_size = kv_cache.spec.block_size
        # Decode-only steps up to its largest size run padded through static buffers (CUDA graphs).
        self.decode_graphs = decode_graphs

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _padded_blocks(self, block_tables: list[list[int]], num_blocks: int) -> torch.Tensor:
        """[num_seqs, num_blocks] block ids; short tables are padded with block 0 (masked by callers)."""
        padded = [table[:num_blocks] + [0] * (num_blocks - len(table[:num_blocks])) for table in block_tables]
        return self._tensor(padded)

    def prepare(
        self, scheduled: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence]]:
        # Single-token rows first: the attention backend batches them as decodes.
        ordered = sorted(scheduled, key=lambda item: item.num_new_tokens != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        metadata = AttentionMetadata(
            write_plan=None,  # type: ignore[arg-type]  # filled below
            num_decodes=0,
            decode_blocks=None,
            decode_context_lens=None,
            decode_bias=None,
            prefills=[],
        )
        decode_tables: list[list[int]] = []
        decode_context_lens: list[int] = []
        size = self.block_size
        for item in ordered:
            seq, num_new = item.seq, item.num_new_tokens
            start_row = len(input_ids)
            first = seq.num_computed_tokens
            context_len = first + num_new
            table = seq.block_table
            input_ids.extend(seq.token_ids[first:context_len])
            positions.extend(range(first, context_len))
            slot_mapping.extend(table[p // size] * size + p % size for p in range(first, context_len))
            metadata.query_start.append(start_row)
            metadata.query_lens.append(num_new)
            metadata.context_lens.append(context_len)
            metadata.block_tables.append(table)
            if context_len == seq.num_tokens:
                logits_rows.append(start_row + num_new - 1)
                sampled.append(seq)
            if num_new == 1:
                metadata.num_decodes += 1
                decode_tables.append(table)
                decode_context_lens.append(context_len)
            else:
                context_blocks = self._padded_blocks([table], -(-context_len // size))[0]
                mask = None
                if first > 0:
                    query_positions = torch.arange(first, context_len, device=self.device)
                    key_positions = torch.arange(context_len, device=self.device)
                    mask = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)
                metadata.prefills.append(
                    PrefillChunk(start_row, start_row + num_new, context_blocks, context_len, mask)
                )

        if decode_tables:
            # Round the padded context up to a bucket: oneDNN compiles a kernel per new matmul shape
            # (~0.4 ms each in bfloat16), so a length growing by one every step would recompile
            # in every layer. Padded positions read block 0 and are masked out.
            bucket_blocks = max(1, DECODE_CONTEXT_BUCKET // size)
            longest_blocks = -(-max(decode_context_lens) // size)
            max_blocks = -(-longest_blocks // bucket_blocks) * bucket_blocks
            max_context = max_blocks * size
            metadata.decode_blocks = self._padded_blocks(decode_tables, max_blocks)
            lengths = metadata.decode_context_lens = self._tensor(decode_context_lens)
            if min(decode_context_lens) != max_context:
                padding = torch.arange(max_context, device=self.device).unsqueeze(0) >= lengths.unsqueeze(1)
                bias = torch.zeros(padding.shape, dtype=torch.float32, device=self.device)
                bias.masked_fill_(padding, float("-inf"))
                metadata.decode_bias = bias.view(1, len(decode_tables), 1, max_context)
        metadata.write_plan = self.kv_cache.make_write_plan(self._tensor(slot_mapping))
        return self._tensor(input_ids), self._tensor(positions), metadata, self._tensor(logits_rows), sampled

    def execute(self, scheduled: list[ScheduledSequence], eager: bool = False) -> ModelRunnerOutput:
        """One forward pass; `eager` keeps it off the decode graphs' static buffers (a step nested in
        another's forward pass must not overwrite what that one may be reading)."""
        graphs = None if eager else self.decode_graphs
        if graphs is not None and len(scheduled) <= graphs.max_batch:
            if all(item.num_new_tokens == 1 for item in scheduled):
                return self._execute_decode_graph(graphs, scheduled)
        input_ids, positions, metadata, logits_rows, sampled = self.prepare(scheduled)
        logits = self.model(input_ids, positions, self.attention, self.kv_cache, metadata, logits_rows)
        return ModelRunnerOutput(sampled, logits)

    def _execute_decode_graph(
        self, graphs: DecodeGraphs, scheduled: list[ScheduledSequence]
    ) -> ModelRunnerOutput:
        size = self.block_size
        batch = DecodeBatch([], [], [], [], [])
        sampled_rows: list[int] = []
        sampled: list[Sequence] = []
        for row, item in enumerate(scheduled):
            seq = item.seq
            position = seq.num_computed_tokens
            batch.input_ids.append(seq.token_ids[position])
            batch.positions.append(position)
            batch.slot_mapping.append(seq.block_table[position // size] * size + position % size)
            batch.block_tables.append(seq.block_table)
            batch.context_lens.append(position + 1)
            # A one-token step is not sampled when it is a chunked prefill with more prompt to come.
            if position + 1 == seq.num_tokens:
                sampled_rows.append(row)
                sampled.append(seq)
        logits = graphs.run(batch)
        if len(sampled_rows) != len(scheduled):
            logits = logits.index_select(0, self._tensor(sampled_rows))
        return ModelRunnerOutput(sampled, logits)
