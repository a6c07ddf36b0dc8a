"""`max_token_bytes`: a text of B UTF-8 bytes is at least ceil(B / max_token_bytes) tokens, for
any text, so a prompt can be refused as too long from its length without tokenizing it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxgate.compression.counting import TiktokenCounter

TEXTS = st.one_of(
    st.text(min_size=1, max_size=400),
    st.builds(
        lambda ch, n: ch * n,
        st.sampled_from(["\n", " ", "=", "-", "a", "\t", "中", "😀"]),
        st.integers(1, 3000),
    ),
    st.lists(st.sampled_from(["the", " ", "\n\n", "<|im_end|>", "////", "ab" * 40, "Ġ"]), max_size=200).map(
        "".join
    ),
)


def _least(text: str, max_token_bytes: int) -> int:
    return -(-len(text.encode("utf-8", "surrogatepass")) // max_token_bytes)


@pytest.fixture(scope="module")
def tiktoken_counter() -> TiktokenCounter:
    return TiktokenCounter()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_the_model_tokenizers_bound_never_exceeds_the_count(tokenizer, text):
    assert _least(text, tokenizer.max_token_bytes) <= max(1, len(tokenizer.encode(text)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_the_tiktoken_bound_never_exceeds_the_count(tiktoken_counter, text):
    assert _least(text, tiktoken_counter.max_token_bytes) <= max(1, len(tiktoken_counter.encode(text)))


def test_the_bound_is_useful_on_a_flood_of_one_character(tokenizer):
    """A megabyte of newlines is over any policy's budget by the bound alone."""
    assert _least("\n" * 1_000_000, tokenizer.max_token_bytes) > 8192
