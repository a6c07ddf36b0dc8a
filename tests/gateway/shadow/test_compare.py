"""The agreement measures of a live answer against its shadow answer."""

from __future__ import annotations

import json

import pytest

from ctxgate.gateway.shadow.compare import compare, key_spans, normalise, token_f1


def test_normalisation_ignores_case_accents_punctuation_articles_and_spacing():
    assert normalise("  The Café,  de Paris! ") == normalise("cafe de paris")
    assert compare("The answer is Paris.", "answer is paris").exact == 1.0
    assert compare("Paris", "Lyon").exact == 0.0


def test_token_f1_is_squads():
    assert token_f1("Marie Curie", "Marie Curie") == 1.0
    assert token_f1("Marie", "Marie Curie") == pytest.approx(2 / 3)  # precision 1, recall 1/2
    assert token_f1("", "") == 1.0 and token_f1("", "Paris") == 0.0
    assert token_f1("Paris", "Lyon") == 0.0


def test_key_spans_are_numbers_dates_and_names():
    spans = key_spans("It was founded by Marie Curie on 7 November 1867 with 1,200 people. Then it grew.")
    assert {"marie curie", "7 november 1867", "1200"} <= spans
    assert "then" not in spans  # a sentence's first word alone is not a name


def test_key_span_recall_counts_the_shadow_answers_spans_found_in_the_live_one():
    shadow = "Marie Curie won in 1903 and 1911."
    assert compare("Curie: 1903, 1911, Marie Curie", shadow).key_spans == 1.0
    assert compare("It was in 1903.", shadow).key_spans == pytest.approx(1 / 3)
    assert compare("anything", "yes, it was").key_spans is None  # nothing to look for


def test_json_output_is_compared_field_by_field():
    shadow = json.dumps({"name": "Paris", "population": 2100000, "tags": ["capital", "city"]})
    live = json.dumps({"name": "Paris", "population": 2000000, "tags": ["capital", "city"]})
    assert compare(live, shadow).json_fields == pytest.approx(3 / 4)
    assert compare("not json", shadow).json_fields == 0.0
    assert compare(shadow, "plain text").json_fields is None
    extra = json.dumps({"name": "Paris", "population": 2100000, "tags": ["capital", "city"], "x": 1})
    assert compare(extra, shadow).json_fields == pytest.approx(4 / 5)  # a field only live has counts


def test_deep_or_huge_json_is_bounded():
    deep = "[" * 5000 + "]" * 5000
    assert compare(deep, deep).json_fields is None  # too deep for the parser: not JSON-comparable
    wide = json.dumps(list(range(20_000)))
    assert compare(wide, wide).json_fields is None  # over the leaf cap


def test_headline_follows_the_policys_choice_and_falls_back_to_token_f1():
    agreement = compare("Paris is the capital", "Paris")
    assert agreement.headline("exact") == ("exact", 0.0)
    assert agreement.headline("auto") == ("token_f1", agreement.token_f1)
    assert agreement.headline("json_fields") == ("token_f1", agreement.token_f1)  # not JSON
    assert compare('{"a": 1}', '{"a": 1}').headline("auto") == ("json_fields", 1.0)
