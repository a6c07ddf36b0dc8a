"""The padding-free forward gives sentence-transformers' vectors, and a sentence's vector does not
depend on the other sentences of its call (no padding, no cross-sentence attention)."""

from __future__ import annotations

import numpy as np
import pytest

from compression.embeddings import Embedder
from compression.packed_encoder import PackedEncoder, attention_buckets, mean_pool, supports

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


def test_buckets_cover_every_token_once_and_bound_padding():
    lengths = [12, 3, 40, 7, 7, 25, 9, 40, 2]
    buckets = attention_buckets(lengths, max_padding_ratio=1.3)
    rows = sorted(int(row) for bucket in buckets for row in bucket.token_index)
    assert rows == list(range(sum(lengths)))
    for bucket in buckets:
        padded_area = bucket.padded_length * bucket.num_sentences
        # A bucket of one sentence has no padding; a wider one stays within the ratio.
        assert bucket.num_sentences == 1 or padded_area <= 1.3 * sum(bucket.lengths)
        assert max(bucket.padded_index.tolist()) < padded_area
    # One batch padded to its longest sentence (sentence-transformers) would be mostly padding.
    assert max(lengths) * len(lengths) > 2.4 * sum(lengths)


def test_mean_pool_averages_each_segment():
    import torch

    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    pooled = mean_pool(hidden, [1, 2, 3])
    expected = torch.tensor([[0.0, 1.0], [3.0, 4.0], [8.0, 9.0]])
    assert torch.allclose(pooled, expected)
