"""Answer scoring."""

from __future__ import annotations

import pytest

from ctxgate.eval.metrics import answer_in_text, exact_match, normalize_answer, token_f1


def test_normalization_drops_case_punctuation_articles():
    assert normalize_answer("The  Beatles!") == "beatles"
    assert normalize_answer("“Gayla Peevey”.") == "gayla peevey"


def test_accuracy_is_whole_word_containment():
    assert answer_in_text("It was sung by Gayla Peevey in 1953.", ["Gayla Peevey"])
    assert answer_in_text("answer: the beatles", ["Beatles", "John"])
    assert not answer_in_text("nobody knows", ["no"])
    assert not answer_in_text("", ["x"])


def test_exact_match_and_f1():
    assert exact_match("The Beatles.", ["beatles"])
    assert not exact_match("The Beatles band", ["beatles"])
    assert token_f1("the beatles band", ["Beatles"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert token_f1("rolling stones", ["Beatles"]) == 0.0
    assert token_f1("x", ["nope", "x"]) == 1.0
