"""A padding-free forward pass for BERT-style sentence embedders (all-MiniLM-L6-v2).

sentence-transformers pads every batch to its longest sentence. Retrieved passages split into
sentences of 5 to 70 word pieces, so about half of a padded batch is padding, and on a CPU every
padded token costs as much as a real one in the matrix multiplies that are nearly all of the cold
compression time. Here the sentences of a call are packed whole into fixed-width chunks (first fit,
longest first), and the whole forward pass runs in that layout: a (chunks x width, hidden) matrix
for the Linear, GELU and LayerNorm work, viewed as (chunks, width) for attention, which is masked
so that a token attends only within its sentence. Only the chunks' leftover slots are padding.

The model's own embeddings and LayerNorm modules are called; its Linear layers run as projections built
once from their weights (`LayerProjections`): Q, K and V fused into one, packed for oneDNN in bf16; an int8
dynamically quantized model's Linear modules are called as they are. The vectors equal
sentence-transformers' mean pooling over the same tokens (cosine >= 0.999 in bf16; tests pin it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Attention runs over chunks of this many token slots, each holding several whole sentences. Wider
# chunks mean fewer, larger attention calls but more masked-out work: bf16 attention is faster over
# 128 slots, float32 activations (float32 and int8 models) no slower over 64.
CHUNK_TOKENS = {"bfloat16": 128, "float32": 64}

# oneDNN builds (JIT-compiles) a GEMM primitive for each input shape and caches it: a bf16 projection
# on a row count it has not seen cost ~15x a cached one here. In chunk layout every call's row count
# is a multiple of the chunk width, so there are a few shapes in all, each built once per process;
# `PackedEncoder.warm_up_batches` covers those up to this many rows (an NQ first sight embeds ~520-720
# word pieces in one call). Longer calls still work; their shapes are built on first sight.
WARM_UP_ROWS = 1024

# A call whose word pieces all fit in this many slots is one chunk of this width, not of the usual
# one: half the slots (GEMM rows) for the small calls that a second hop, a question alone or a
# mostly warm cache make (a 57-word-piece second hop filled a third of a 128-slot chunk).
SMALL_CALL_TOKENS = 64


@dataclass
class PackedBatch:
    """Sentences packed end to end: token ids (T,), their positions (T,), and one row per sentence."""

    input_ids: Any  # torch.LongTensor (T,)
    position_ids: Any  # torch.LongTensor (T,)
    lengths: list[int]  # word pieces per sentence, in input order


def supports(model: Any) -> bool:
    """True for a sentence-transformers model that is a BERT encoder with mean pooling (then
    optionally normalization): the layout this module reproduces."""
    try:
        transformer, pooling = model[0], model[1]
    except (TypeError, IndexError, KeyError):
        return False
    bert = getattr(transformer, "auto_model", None) or getattr(transformer, "model", None)
    config = getattr(bert, "config", None)
    if config is None or getattr(config, "model_type", None) != "bert":
        return False
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return False
    if getattr(config, "hidden_act", None) not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        return False
    mode = getattr(pooling, "pooling_mode_mean_tokens", None)
    if mode is None:
        mode = getattr(pooling, "pooling_mode", None) == "mean"
    return bool(mode) and hasattr(bert, "embeddings") and hasattr(bert, "encoder")


class PackedEncoder:
    """`encode(texts) -> (len(texts), hidden) float32` mean-pooled, not normalized."""

    def __init__(self, model: Any, max_seq_length: int, chunk_tokens: int | None = None):
        """`chunk_tokens`: the chunk width (default by activation dtype, CHUNK_TOKENS)."""
        self.tokenizer = model.tokenizer
        self.bert = getattr(model[0], "auto_model", None) or model[0].model
        self.max_seq_length = max_seq_length
        config = self.bert.config
        self.num_heads = int(config.num_attention_heads)
        self.head_dim = int(config.hidden_size) // self.num_heads
        self.hidden = int(config.hidden_size)
        gelu_approximate = "tanh" if config.hidden_act in ("gelu_new", "gelu_pytorch_tanh") else "none"
        self.layers = [LayerProjections.of(layer, gelu_approximate) for layer in self.bert.encoder.layer]
        import torch

        bf16 = self.bert.embeddings.word_embeddings.weight.dtype == torch.bfloat16
        self.chunk_tokens = chunk_tokens or CHUNK_TOKENS["bfloat16" if bf16 else "float32"]
        self.builds_per_shape = any(projection.packed for layer in self.layers for projection in layer.all())

    def pack(self, texts: list[str]) -> PackedBatch:
        import torch

        encoded = self.tokenizer(
            texts, truncation=True, max_length=self.max_seq_length, padding=False, return_attention_mask=False
        )["input_ids"]
        lengths = [len(ids) for ids in encoded]
        flat = [token for ids in encoded for token in ids]
        positions = [position for length in lengths for position in range(length)]
        return PackedBatch(
            torch.tensor(flat, dtype=torch.long), torch.tensor(positions, dtype=torch.long), lengths
        )

    def encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.hidden), dtype=np.float32)
        return self.encode_packed(self.pack(texts))

    def encode_packed(self, batch: PackedBatch) -> np.ndarray:
        """The forward pass alone: `pack` (the tokenizer) can run on another thread first."""
        import torch

        if not batch.lengths:
            return np.zeros((0, self.hidden), dtype=np.float32)
        chunks = AttentionChunks(batch.lengths, self.chunk_width(batch.lengths))
        with torch.inference_mode():
            hidden = self._embed(batch, chunks)
            for layer, projections in zip(self.bert.encoder.layer, self.layers, strict=True):
                hidden = self._layer(layer, projections, hidden, chunks)
            return mean_pool(hidden[chunks.token_slots], batch.lengths).float().numpy()

    def chunk_width(self, lengths: list[int]) -> int:
        """The chunk width of a call: SMALL_CALL_TOKENS when every word piece fits in one such chunk."""
        return (
            SMALL_CALL_TOKENS if sum(lengths) <= SMALL_CALL_TOKENS < self.chunk_tokens else self.chunk_tokens
        )

    def warm_up_batches(self, max_rows: int | None = None) -> list[PackedBatch]:
        """One synthetic batch per chunk count up to `max_rows` rows (WARM_UP_ROWS), for
        `encode_packed` at startup, so that oneDNN's per-shape GEMM builds are paid then and not by
        the first requests; none off the oneDNN path (its GEMMs are not built per shape)."""
        import torch

        if not self.builds_per_shape:
            return []
        width = self.chunk_tokens
        token_id = int(self.tokenizer.cls_token_id or 0)
        # One sentence per chunk: a layout real calls also produce. A small call's single chunk first.
        layouts = [(1, SMALL_CALL_TOKENS)] if SMALL_CALL_TOKENS < width else []
        layouts += [(num_chunks, width) for num_chunks in range(1, (max_rows or WARM_UP_ROWS) // width + 1)]
        return [
            PackedBatch(
                torch.full((num_chunks * chunk_width,), token_id, dtype=torch.long),
                torch.arange(chunk_width, dtype=torch.long).repeat(num_chunks),
                [chunk_width] * num_chunks,
            )
            for num_chunks, chunk_width in layouts
        ]

    def _embed(self, batch: PackedBatch, chunks: AttentionChunks) -> Any:
        import torch
        import torch.nn.functional as functional

        # Into chunk layout; a padding slot holds token 0 at position 0 (never attended to or pooled).
        input_ids = functional.pad(batch.input_ids, (0, 1))[chunks.source_rows]
        position_ids = functional.pad(batch.position_ids, (0, 1))[chunks.source_rows]
        embeddings = self.bert.embeddings
        hidden = embeddings.word_embeddings(input_ids)
        hidden = hidden + embeddings.position_embeddings(position_ids)
        hidden = hidden + embeddings.token_type_embeddings(torch.zeros_like(input_ids))
        return embeddings.LayerNorm(hidden)

    def _layer(self, layer: Any, projections: LayerProjections, hidden: Any, chunks: AttentionChunks) -> Any:
        context = self._attention(projections.qkv(hidden), chunks)
        hidden = layer.attention.output.LayerNorm(projections.attention_out(context) + hidden)
        intermediate = projections.intermediate(hidden)
        return layer.output.LayerNorm(projections.output(intermediate) + hidden)

    def _attention(self, qkv: Any, chunks: AttentionChunks) -> Any:
        import torch.nn.functional as functional

        block = qkv.view(chunks.num_chunks, chunks.width, 3, self.num_heads, self.head_dim)
        query, key, value = (part.transpose(1, 2) for part in block.unbind(2))
        out = functional.scaled_dot_product_attention(query, key, value, attn_mask=chunks.mask(qkv.dtype))
        return out.transpose(1, 2).reshape(-1, self.hidden)


class Projection:
    """One Linear of the encoder, optionally followed by GELU. A bfloat16 weight on a CPU whose
    oneDNN has a native bf16 GEMM is packed once into oneDNN's blocked layout (eager `linear`
    re-lays it out on every call) and GELU runs as the GEMM's post-op: ~0.75x the time of the
    module call. Anything else (float32, int8 dynamically quantized modules) calls the module."""

    def __init__(self, module: Any, gelu_approximate: str | None = None):
        self.module = module
        self.gelu_approximate = gelu_approximate
        self._packed_weight = _mkldnn_bf16_weight(module)

    @property
    def packed(self) -> bool:
        return self._packed_weight is not None

    def __call__(self, hidden: Any) -> Any:
        import torch
        import torch.nn.functional as functional

        if self._packed_weight is not None:
            post_op = "gelu" if self.gelu_approximate is not None else "none"
            algorithm = self.gelu_approximate or ""
            return torch.ops.mkldnn._linear_pointwise(
                hidden, self._packed_weight, self.module.bias, post_op, [], algorithm
            )
        out = self.module(hidden)
        if self.gelu_approximate is not None:
            out = functional.gelu(out, approximate=self.gelu_approximate)
        return out


def _mkldnn_bf16_weight(module: Any) -> Any:
    """The same decision as the engine's prefill matmuls (`ctxgate.backend.model.linear.configure_matmuls`)."""
    import torch

    from ctxgate.backend.platform.cpu_features import cpu_path, onednn_packing_available

    weight = getattr(module, "weight", None)
    if type(module) is not torch.nn.Linear or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    if not (cpu_path().onednn_bf16 and onednn_packing_available()):
        return None
    with torch.inference_mode():
        # The batch size is only a layout hint; 512 rows is a typical call.
        return torch.ops.mkldnn._reorder_linear_weight(module.weight, 512)


class _QKV:
    """Q, K and V side by side (T, 3 x hidden). Plain Linear layers are fused into one (one GEMM
    three times as wide); quantized ones (their weights are not plain tensors) run one by one."""

    def __init__(self, attention: Any):
        import torch

        parts = [attention.query, attention.key, attention.value]
        self.parts: list[Projection] = []
        if all(type(part) is torch.nn.Linear for part in parts):
            fused = torch.nn.Linear(parts[0].in_features, sum(part.out_features for part in parts))
            with torch.no_grad():
                fused.weight.copy_(torch.cat([part.weight.float() for part in parts]))
                fused.bias.copy_(torch.cat([part.bias.float() for part in parts]))
            weight = parts[0].weight
            self.parts = [
                Projection(fused.to(device=weight.device, dtype=weight.dtype).requires_grad_(False))
            ]
        else:
            self.parts = [Projection(part) for part in parts]

    def __call__(self, hidden: Any) -> Any:
        import torch

        if len(self.parts) == 1:
            return self.parts[0](hidden)
        return torch.cat([part(hidden) for part in self.parts], 1)


@dataclass
class LayerProjections:
    qkv: _QKV
    attention_out: Projection
    intermediate: Projection  # with the GELU
    output: Projection

    def all(self) -> list[Projection]:
        return [*self.qkv.parts, self.attention_out, self.intermediate, self.output]

    @classmethod
    def of(cls, layer: Any, gelu_approximate: str) -> LayerProjections:
        return cls(
            _QKV(layer.attention.self),
            Projection(layer.attention.output.dense),
            Projection(layer.intermediate.dense, gelu_approximate),
            Projection(layer.output.dense),
        )


class AttentionChunks:
    """The chunk layout: sentences are packed whole into chunks of `width` slots (first fit, longest
    first). One attention call covers every chunk, with a mask that lets a token see only its own
    sentence. Few wide chunks cost less than many calls over small per-length buckets (the CPU
    attention kernel's fixed cost per call dominates at sentence lengths), and little is left
    padding because short sentences fill the gaps."""

    def __init__(self, lengths: list[int], chunk_tokens: int):
        import torch

        self.width = max(chunk_tokens, max(lengths))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
        free: list[int] = []  # free slots per chunk
        placed: list[tuple[int, int]] = [(0, 0)] * len(lengths)  # (chunk, first slot) per sentence
        for index in sorted(range(len(lengths)), key=lambda index: -lengths[index]):
            chunk = next((c for c, room in enumerate(free) if room >= lengths[index]), None)
            if chunk is None:
                chunk = len(free)
                free.append(self.width)
            placed[index] = (chunk, self.width - free[chunk])
            free[chunk] -= lengths[index]
        self.num_chunks = len(free)
        total_tokens = int(sum(lengths))
        slots = self.num_chunks * self.width
        source = torch.full((slots,), total_tokens, dtype=torch.long)  # padding slots -> one past the tokens
        segment = torch.full((slots,), -1, dtype=torch.long)
        token_slots = torch.zeros(total_tokens, dtype=torch.long)
        for index, (chunk, first_slot) in enumerate(placed):
            slot = chunk * self.width + first_slot
            tokens = torch.arange(starts[index], starts[index] + lengths[index])
            source[slot : slot + lengths[index]] = tokens
            token_slots[tokens] = torch.arange(slot, slot + lengths[index])
            segment[slot : slot + lengths[index]] = index
        self.source_rows = source  # per slot: its token in packed (input) order, or the padding index
        self.token_slots = token_slots  # per token in packed order: its slot
        self.segments = segment.view(self.num_chunks, self.width)
        self._masks: dict[Any, Any] = {}

    def mask(self, dtype: Any) -> Any:
        """Additive (chunks, 1, width, width): 0 where query and key are in the same sentence.
        Padding slots see only padding, so no row is fully masked, and no token sees a padding slot."""
        import torch

        if dtype not in self._masks:
            same = self.segments[:, :, None] == self.segments[:, None, :]
            mask = torch.zeros(same.shape, dtype=dtype).masked_fill_(~same, torch.finfo(dtype).min)
            self._masks[dtype] = mask[:, None]
        return self._masks[dtype]


def mean_pool(hidden: Any, lengths: list[int]) -> Any:
    """Mean of each sentence's token rows (the packed layout's segment means)."""
    import torch

    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    sums = hidden.float().new_zeros(len(lengths), hidden.shape[-1])
    sums.index_add_(0, segment, hidden.float())
    return sums / torch.tensor(lengths, dtype=torch.float32)[:, None]
