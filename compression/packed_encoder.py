"""A padding-free forward pass for BERT-style sentence embedders (all-MiniLM-L6-v2).

sentence-transformers pads every batch to its longest sentence. Retrieved passages split into
sentences of 5 to 70 word pieces, so about half of a padded batch is padding, and on a CPU every
padded token costs as much as a real one in the matrix multiplies that are nearly all of the cold
compression time. Here the sentences of a call are packed into one (total_tokens, hidden) matrix:
the Linear, GELU and LayerNorm work sees only real tokens, and only attention, which needs the
(sentence, position) shape, is padded, in buckets of similar lengths.

The model's own modules (embeddings, Linear, LayerNorm) are called, not copies of their weights, so
a bfloat16 model or an int8 dynamically quantized one runs here unchanged. The vectors equal
sentence-transformers' mean pooling over the same tokens (cosine >= 0.999 in bf16; tests pin it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Sentences are bucketed for attention so that a bucket's padded area stays within this multiple of
# its real tokens; more buckets mean more (smaller) attention calls.
MAX_PADDING_RATIO = 1.3


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

    def __init__(self, model: Any, max_seq_length: int):
        self.tokenizer = model.tokenizer
        self.bert = getattr(model[0], "auto_model", None) or model[0].model
        self.max_seq_length = max_seq_length
        config = self.bert.config
        self.num_heads = int(config.num_attention_heads)
        self.head_dim = int(config.hidden_size) // self.num_heads
        self.hidden = int(config.hidden_size)
        self.gelu_approximate = "tanh" if config.hidden_act in ("gelu_new", "gelu_pytorch_tanh") else "none"

    def pack(self, texts: list[str]) -> PackedBatch:
        import torch

        encoded = self.tokenizer(
            texts, truncation=True, max_length=self.max_seq_length, padding=False, return_attention_mask=False
        )["input_ids"]
        lengths = [len(ids) for ids in encoded]
        flat = [token for ids in encoded for token in ids]
        positions = [position for length in lengths for position in range(length)]
        return PackedBatch(torch.tensor(flat, dtype=torch.long), torch.tensor(positions, dtype=torch.long), lengths)

    def encode(self, texts: list[str]) -> np.ndarray:
        import torch

        if not texts:
            return np.zeros((0, self.hidden), dtype=np.float32)
        batch = self.pack(texts)
        with torch.inference_mode():
            hidden = self._embed(batch)
            layout = AttentionLayout(attention_buckets(batch.lengths))
            for layer in self.bert.encoder.layer:
                hidden = self._layer(layer, hidden, layout)
            return mean_pool(hidden, batch.lengths).float().numpy()

    def _embed(self, batch: PackedBatch) -> Any:
        import torch

        embeddings = self.bert.embeddings
        hidden = embeddings.word_embeddings(batch.input_ids)
        hidden = hidden + embeddings.position_embeddings(batch.position_ids)
        hidden = hidden + embeddings.token_type_embeddings(torch.zeros_like(batch.input_ids))
        return embeddings.LayerNorm(hidden)

    def _layer(self, layer: Any, hidden: Any, layout: AttentionLayout) -> Any:
        import torch.nn.functional as functional

        attention = layer.attention
        context = self._attention(attention.self, hidden, layout)
        hidden = attention.output.LayerNorm(attention.output.dense(context) + hidden)
        intermediate = functional.gelu(layer.intermediate.dense(hidden), approximate=self.gelu_approximate)
        return layer.output.LayerNorm(layer.output.dense(intermediate) + hidden)

    def _attention(self, module: Any, hidden: Any, layout: AttentionLayout) -> Any:
        import torch
        import torch.nn.functional as functional

        # Q, K and V side by side plus one zero row: each bucket's padded (sentences x length) block
        # is then a single gather (padding slots point at the zero row), and the buckets' outputs,
        # concatenated, go back to packed order in one more gather per layer.
        qkv = torch.cat([module.query(hidden), module.key(hidden), module.value(hidden)], 1)
        qkv = torch.cat([qkv, qkv.new_zeros(1, qkv.shape[1])])
        outputs = []
        for bucket in layout.buckets:
            block = qkv[bucket.source_rows].view(
                bucket.num_sentences, bucket.padded_length, 3, self.num_heads, self.head_dim
            )
            query, key, value = (part.transpose(1, 2) for part in block.unbind(2))
            out = functional.scaled_dot_product_attention(query, key, value, attn_mask=bucket.mask(qkv.dtype))
            outputs.append(out.transpose(1, 2).reshape(-1, self.hidden))
        return torch.cat(outputs)[layout.packed_order]


@dataclass
class AttentionBucket:
    """Sentences attended together, padded to the longest of them."""

    token_index: Any  # rows of the packed matrix that belong to the bucket's sentences
    padded_index: Any  # where each of those rows sits in the (sentences * padded_length) layout
    lengths: list[int]
    padded_length: int
    source_rows: Any  # per padded slot: its packed row, or the total token count (a zero row) for padding
    _masks: dict[Any, Any] = field(default_factory=dict, repr=False)  # by dtype: built once, used per layer

    @property
    def num_sentences(self) -> int:
        return len(self.lengths)

    def mask(self, dtype: Any) -> Any:
        """Additive key mask (sentences, 1, 1, padded_length): padding is never attended to."""
        import torch

        if dtype not in self._masks:
            positions = torch.arange(self.padded_length)
            valid = positions[None, :] < torch.tensor(self.lengths)[:, None]
            mask = torch.zeros(valid.shape, dtype=dtype)
            mask.masked_fill_(~valid, torch.finfo(dtype).min)
            self._masks[dtype] = mask[:, None, None, :]
        return self._masks[dtype]


def attention_buckets(lengths: list[int], max_padding_ratio: float = MAX_PADDING_RATIO) -> list[AttentionBucket]:
    """Group sentences (longest first) so each group's padded area <= max_padding_ratio x its tokens."""
    import torch

    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
    order = sorted(range(len(lengths)), key=lambda index: -lengths[index])
    groups: list[list[int]] = []
    for index in order:
        if groups:
            group = groups[-1]
            longest = lengths[group[0]]
            real = sum(lengths[member] for member in group) + lengths[index]
            if longest * (len(group) + 1) <= max_padding_ratio * real:
                group.append(index)
                continue
        groups.append([index])
    buckets = []
    for group in groups:
        padded_length = lengths[group[0]]
        token_rows: list[int] = []
        padded_rows: list[int] = []
        for slot, index in enumerate(group):
            token_rows.extend(range(starts[index], starts[index] + lengths[index]))
            padded_rows.extend(range(slot * padded_length, slot * padded_length + lengths[index]))
        source = torch.full((len(group) * padded_length,), int(sum(lengths)), dtype=torch.long)
        source[padded_rows] = torch.tensor(token_rows, dtype=torch.long)
        buckets.append(
            AttentionBucket(
                torch.tensor(token_rows, dtype=torch.long),
                torch.tensor(padded_rows, dtype=torch.long),
                [lengths[index] for index in group],
                padded_length,
                source,
            )
        )
    return buckets


class AttentionLayout:
    """A call's buckets, and where each packed row sits in their concatenated padded outputs."""

    def __init__(self, buckets: list[AttentionBucket]):
        import torch

        self.buckets = buckets
        offsets = np.cumsum([0] + [bucket.num_sentences * bucket.padded_length for bucket in buckets])
        total_tokens = sum(len(bucket.token_index) for bucket in buckets)
        order = torch.empty(total_tokens, dtype=torch.long)
        for bucket, offset in zip(buckets, offsets, strict=False):
            order[bucket.token_index] = bucket.padded_index + int(offset)
        self.packed_order = order


def mean_pool(hidden: Any, lengths: list[int]) -> Any:
    """Mean of each sentence's token rows (the packed layout's segment means)."""
    import torch

    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    sums = hidden.float().new_zeros(len(lengths), hidden.shape[-1])
    sums.index_add_(0, segment, hidden.float())
    return sums / torch.tensor(lengths, dtype=torch.float32)[:, None]
