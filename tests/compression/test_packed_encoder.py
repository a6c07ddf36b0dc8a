"""The padding-free forward gives sentence-transformers' vectors, and a sentence's vector does not
depend on the other sentences of its call (no padding, no cross-sentence attention)."""

from __future__ import annotations

import numpy as np
import pytest

from ctxgate.backend.platform.cpu_features import cpu_path
from ctxgate.compression.embedding.embeddings import Embedder
from ctxgate.compression.embedding.packed_encoder import (
    SMALL_CALL_TOKENS,
    AttentionChunks,
    PackedEncoder,
    mean_pool,
    supports,
)

NATIVE_BF16 = cpu_path().kernel_isa == "avx512_bf16"
INT8_KERNELS = cpu_path().kernel_isa != "portable"

SENTENCES = [
    "Paris is the capital and most populous city of France.",
    "Hi.",
    "The Eiffel Tower was completed in 1889 for the World's Fair, and for forty-one years it was the "
    "tallest man-made structure in the world, until the Chrysler Building in New York overtook it.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "Water boils at 100 degrees Celsius at sea level.",
]


@pytest.fixture(scope="module")
def float32_embedder():
    return Embedder(precision="float32")


def unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_the_bundled_model_takes_the_packed_path(float32_embedder):
    assert supports(float32_embedder.model)
    assert float32_embedder._packed is not None


def test_packed_vectors_equal_sentence_transformers_padded_ones(float32_embedder):
    packed = unit(float32_embedder._packed.encode(SENTENCES))
    padded = float32_embedder.model.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=True)
    cosines = (packed * padded).sum(axis=1)
    assert cosines.min() > 0.99999, cosines


def test_a_sentence_vector_does_not_depend_on_its_neighbours(float32_embedder):
    encoder = float32_embedder._packed
    together = encoder.encode(SENTENCES)
    for index, sentence in enumerate(SENTENCES):
        alone = encoder.encode([sentence])[0]
        np.testing.assert_allclose(together[index], alone, rtol=1e-4, atol=1e-5)


def test_long_sentences_are_cut_at_the_model_limit(float32_embedder):
    encoder = PackedEncoder(float32_embedder.model, max_seq_length=8)
    batch = encoder.pack(["one two three four five six seven eight nine ten eleven twelve", "short"])
    assert batch.lengths[0] == 8
    assert batch.position_ids.tolist()[:8] == list(range(8))
    assert len(batch.input_ids) == sum(batch.lengths)


def test_chunks_hold_every_token_once_and_each_sentence_whole():
    lengths = [12, 3, 40, 7, 7, 25, 9, 40, 2, 128]
    chunks = AttentionChunks(lengths, chunk_tokens=64)
    assert chunks.width == 128  # the longest sentence sets the width
    source = chunks.source_rows.tolist()
    total = sum(lengths)
    assert sorted(row for row in source if row != total) == list(range(total))
    # token_slots is the inverse of source_rows on the real tokens.
    assert [source[slot] for slot in chunks.token_slots.tolist()] == list(range(total))
    segments = chunks.segments.flatten().tolist()
    starts = [sum(lengths[:index]) for index in range(len(lengths))]
    for index, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        slots = chunks.token_slots[start : start + length].tolist()
        assert slots == list(range(slots[0], slots[0] + length)), "a sentence sits contiguously"
        assert slots[0] // chunks.width == slots[-1] // chunks.width, "a sentence never straddles chunks"
        assert {segments[slot] for slot in slots} == {index}
    # First fit, longest first: 263 tokens in 128-slot chunks need 3, not one per sentence.
    assert chunks.num_chunks == 3


def test_the_chunk_mask_keeps_attention_inside_each_sentence():
    import torch

    chunks = AttentionChunks([3, 2, 4], chunk_tokens=16)
    mask = chunks.mask(torch.float32)[:, 0]
    allowed = mask == 0
    segments = chunks.segments
    for chunk in range(chunks.num_chunks):
        for query in range(chunks.width):
            for key in range(chunks.width):
                same = bool(segments[chunk, query] == segments[chunk, key])
                assert bool(allowed[chunk, query, key]) == same
    assert allowed.any(dim=-1).all(), "no query row is fully masked (no NaN from softmax)"


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8"])
def test_every_precision_matches_the_padded_forward(precision):
    if precision == "bfloat16" and not NATIVE_BF16:
        pytest.skip("this CPU has no native bf16 GEMM (avx512_bf16 / amx_bf16)")
    if precision == "int8" and not INT8_KERNELS:
        pytest.skip("fbgemm's int8 kernels need avx2")
    reference = Embedder(precision="float32").model.encode(SENTENCES, normalize_embeddings=True)
    embedder = Embedder(precision=precision)
    packed = (unit(embedder._packed.encode(SENTENCES)) * reference).sum(axis=1)
    padded = (unit(embedder.model.encode(SENTENCES).astype(np.float32)) * reference).sum(axis=1)
    # The packed forward is no further from float32 than the model's own padded forward in the
    # same precision. int8 is far from it either way (~0.89 for a three-word sentence), and its
    # per-call activation scale moves a short sentence by a few hundredths with whatever rows share
    # the call, so there the mean is compared (over 383 NQ sentences: 0.9427 packed, 0.9426 padded).
    if precision == "int8":
        assert packed.mean() >= padded.mean() - 0.01, (packed, padded)
    else:
        assert (packed >= padded - 0.002).all(), (packed, padded)
    assert packed.min() > {"float32": 0.99999, "bfloat16": 0.995, "int8": 0.85}[precision]


def test_plain_linear_projections_are_fused_and_quantized_ones_are_not(float32_embedder):
    import torch

    layer = PackedEncoder(float32_embedder.model, 128).layers[0]
    assert len(layer.qkv.parts) == 1
    attention = float32_embedder.model[0].auto_model.encoder.layer[0].attention.self
    hidden = torch.randn(5, attention.query.in_features)
    with torch.inference_mode():
        separate = torch.cat([attention.query(hidden), attention.key(hidden), attention.value(hidden)], 1)
        assert torch.allclose(layer.qkv(hidden), separate, atol=1e-5)
    if INT8_KERNELS:  # fbgemm's int8 kernels need avx2
        quantized = PackedEncoder(Embedder(precision="int8").model, 128).layers[0]
        assert len(quantized.qkv.parts) == 3


def test_the_chunk_layout_changes_no_vector(float32_embedder):
    narrow = PackedEncoder(float32_embedder.model, 128, chunk_tokens=32)
    wide = PackedEncoder(float32_embedder.model, 128, chunk_tokens=256)
    lengths = narrow.pack(SENTENCES).lengths
    assert AttentionChunks(lengths, 32).num_chunks > 1 and AttentionChunks(lengths, 256).num_chunks == 1
    np.testing.assert_allclose(narrow.encode(SENTENCES), wide.encode(SENTENCES), rtol=1e-4, atol=1e-5)


def test_row_counts_recur_as_multiples_of_the_chunk_width(float32_embedder):
    encoder = float32_embedder._packed
    for texts in (SENTENCES, SENTENCES[:2], SENTENCES * 7):
        chunks = AttentionChunks(encoder.pack(texts).lengths, encoder.chunk_tokens)
        assert len(chunks.source_rows) == chunks.num_chunks * chunks.width
        assert chunks.width == encoder.chunk_tokens


def test_the_onednn_bf16_path_builds_per_shape_and_warms_up():
    if not NATIVE_BF16:
        pytest.skip("this CPU has no native bf16 GEMM (avx512_bf16 / amx_bf16)")
    encoder = Embedder(precision="bfloat16")._packed
    assert encoder.builds_per_shape and encoder.chunk_tokens == 128
    assert [len(batch.input_ids) for batch in encoder.warm_up_batches(max_rows=384)] == [64, 128, 256, 384]


def test_a_small_call_is_one_narrow_chunk_with_the_same_vectors(float32_embedder):
    encoder = PackedEncoder(float32_embedder.model, 128, chunk_tokens=128)
    small = [SENTENCES[0], SENTENCES[1], SENTENCES[4]]
    small_lengths = encoder.pack(small).lengths
    assert sum(small_lengths) <= SMALL_CALL_TOKENS and encoder.chunk_width(small_lengths) == SMALL_CALL_TOKENS
    many = SENTENCES * 3
    assert encoder.chunk_width(encoder.pack(many).lengths) == 128
    # A sentence's vector does not depend on its call's layout.
    alone = encoder.encode(small)
    among_many = encoder.encode(many)[[0, 1, 4]]
    np.testing.assert_allclose(alone, among_many, rtol=1e-4, atol=1e-5)
    encoder.builds_per_shape = True
    assert len(encoder.warm_up_batches(max_rows=128)[0].input_ids) == SMALL_CALL_TOKENS, (
        "its shape is warmed up"
    )


def test_mean_pool_averages_each_segment():
    import torch

    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    pooled = mean_pool(hidden, [1, 2, 3])
    expected = torch.tensor([[0.0, 1.0], [3.0, 4.0], [8.0, 9.0]])
    assert torch.allclose(pooled, expected)


def test_warm_up_batches_cover_each_chunk_count(float32_embedder):
    encoder = PackedEncoder(float32_embedder.model, 128, chunk_tokens=64)
    assert not encoder.builds_per_shape and encoder.warm_up_batches() == [], "off oneDNN nothing to warm up"
    encoder.builds_per_shape = True  # as on the oneDNN bf16 path, whatever this CPU has
    batches = encoder.warm_up_batches(max_rows=256)
    assert [len(batch.input_ids) for batch in batches] == [64, 128, 192, 256]
    for batch in batches:
        chunks = AttentionChunks(batch.lengths, encoder.chunk_tokens)
        assert chunks.num_chunks * chunks.width == len(batch.input_ids), "no padding: the shape is exact"
        vectors = encoder.encode_packed(batch)
        assert vectors.shape == (len(batch.lengths), encoder.hidden) and np.isfinite(vectors).all()
