"""The console's key forms read the keys file's limits, words and numbers alike (key_forms.py)."""

from __future__ import annotations

import pytest

from ctxgate.gateway.console.key_forms import LIMIT_FIELDS, FieldError, limits_from


def test_word_limits_are_read_as_words():
    limits = limits_from({"window": "fixed", "time_zone": "Europe/Paris", "tokens_per_month": "5000"})
    assert limits.window == "fixed"
    assert str(limits.time_zone) == "Europe/Paris"
    assert limits.tokens_per_month == 5000


@pytest.mark.parametrize(
    ("form", "field"),
    [
        ({"window": "rolling"}, "window"),
        ({"time_zone": "Mars/Olympus"}, "time_zone"),
        ({"tokens_per_day": "lots"}, "tokens_per_day"),
    ],
)
def test_a_bad_limit_names_its_field(form, field):
    with pytest.raises(FieldError) as raised:
        limits_from(form)
    assert raised.value.field == field


def test_the_per_model_table_is_not_a_form_input():
    assert "models" not in LIMIT_FIELDS
