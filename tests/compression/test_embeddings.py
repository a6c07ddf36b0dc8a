"""The embedding model's precision follows the CPU: bfloat16 on AMX, int8 dynamic quantization on
AVX-512 without AMX and on AVX2, float32 below; vectors of different precisions never share a cache entry."""

from __future__ import annotations

import numpy as np
import pytest

from ctxgate.backend.platform.cpu_features import cpu_path
from ctxgate.compression.embedding.embeddings import Embedder
from ctxgate.compression.embedding.precision import choose_precision
from ctxgate.compression.store.cache import LRUBytesCache

NATIVE_BF16 = cpu_path().kernel_isa == "avx512_bf16"
SENTENCES = [
    "Paris is the capital and most populous city of France.",
    "The Eiffel Tower was completed in 1889 for the World's Fair.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "A stuffed-documents chain puts every retrieved passage into one prompt.",
]


@pytest.mark.parametrize(
    ("kernel_isa", "amx", "requested", "expected"),
    [
        ("avx512_bf16", True, None, "bfloat16"),
        ("avx512_bf16", True, "auto", "bfloat16"),
        ("avx512_bf16", False, None, "int8"),
        ("avx512_bf16", False, "bfloat16", "bfloat16"),
        ("avx2", False, None, "int8"),
        ("avx2", False, "", "int8"),
        ("portable", False, None, "float32"),
        ("avx512_bf16", True, "int8", "int8"),
        ("avx2", False, "float32", "float32"),
        ("avx512_bf16", True, " Float32 ", "float32"),
    ],
)
def test_precision_follows_the_cpu_unless_asked(kernel_isa, amx, requested, expected):
    assert choose_precision(kernel_isa, requested, amx=amx) == expected


def test_bf16_without_a_native_gemm_and_unknown_names_are_refused_by_name():
    with pytest.raises(ValueError, match="CTXGATE_EMBED_PRECISION=bfloat16 needs"):
        choose_precision("avx2", "bfloat16")
    with pytest.raises(ValueError, match="not 'fp8'"):
        choose_precision("avx512_bf16", "fp8")


@pytest.fixture(scope="module")
def float32_embedder():
    return Embedder(precision="float32")


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_each_precision_gives_unit_vectors_close_to_float32(precision, float32_embedder):
    if precision == "bfloat16" and not NATIVE_BF16:
        pytest.skip("this CPU has no native bf16 GEMM (avx512_bf16 / amx_bf16)")
    if precision == "int8" and cpu_path().kernel_isa == "portable":
        pytest.skip("fbgemm's int8 kernels need avx2")
    embedder = Embedder(precision=precision)
    vectors = embedder.embed(SENTENCES)
    reference = float32_embedder.embed(SENTENCES)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    cosines = (vectors * reference).sum(axis=1)
    # bf16 keeps float32's geometry almost exactly; int8 is noisier but still the same space.
    assert cosines.min() > (0.99 if precision == "bfloat16" else 0.8)
    # Same ranking of the passages for a question, which is what the rerank stage uses.
    question = "What is the capital of France?"
    ranked = np.argsort(-(vectors @ embedder.embed([question])[0]))
    assert ranked[0] == int(np.argmax(reference @ float32_embedder.embed([question])[0])) == 0


def test_precisions_never_share_cached_vectors(float32_embedder):
    shared = LRUBytesCache()
    float32_embedder._cache = shared
    int8 = Embedder(cache=shared, precision="int8")
    try:
        float32_embedder.embed(SENTENCES[:1])
        assert float32_embedder.encoded_texts >= 1
        before = int8.encoded_texts
        int8.embed(SENTENCES[:1])
        assert int8.encoded_texts == before + 1  # a miss: the float32 vector is not reused
        assert float32_embedder._key_prefix != int8._key_prefix
    finally:
        float32_embedder._cache = None
