"""The fit decision (gateway/fit.py): the budget a request over a limit gets, the floor, the output cap."""

from __future__ import annotations

import pytest

from ctxgate.gateway.fit import Fit, FitRefused, fit_into
from ctxgate.policies.schema import FitPolicy, Policy

COMPRESS = FitPolicy(quota="compress", min_context_tokens=300)


def test_a_request_that_fits_is_not_fitted():
    assert fit_into(COMPRESS, "quota", room=2_000, prompt_tokens=1_700, output_tokens=300, choices=1) is None


def test_the_budget_is_what_remains_minus_the_output_reservation():
    fit = fit_into(COMPRESS, "quota", room=1_000, prompt_tokens=2_048, output_tokens=256, choices=1)
    assert fit == Fit("quota", budget=744, output_tokens=256, would_have_needed=2_304)
    assert fit.report() == {"bound_by": "quota", "budget": 744, "would_have_needed": 2_304}


def test_each_choice_keeps_its_own_output_reservation():
    fit = fit_into(COMPRESS, "quota", room=1_000, prompt_tokens=2_048, output_tokens=3 * 100, choices=3)
    assert fit is not None and (fit.budget, fit.output_tokens) == (700, 100)


def test_under_the_floor_the_request_is_refused_with_what_it_needed():
    reject_output = COMPRESS.model_copy(update={"output": "reject"})
    with pytest.raises(FitRefused) as info:
        fit_into(reject_output, "quota", room=500, prompt_tokens=2_048, output_tokens=256, choices=1)
    assert (info.value.needed, info.value.room) == (2_304, 500)
    assert "2304 tokens" in str(info.value) and "floor of 300" in str(info.value)


def test_output_cap_lowers_max_tokens_so_the_prompt_keeps_the_floor():
    fit = fit_into(COMPRESS, "quota", room=500, prompt_tokens=2_048, output_tokens=256, choices=1)
    assert fit is not None and (fit.budget, fit.output_tokens) == (300, 200)
    # A prompt smaller than the floor keeps all of itself; the output gets the rest.
    small = fit_into(COMPRESS, "quota", room=400, prompt_tokens=120, output_tokens=1_000, choices=1)
    assert small is not None and (small.budget, small.output_tokens) == (120, 280)


def test_no_room_for_a_single_output_token_is_refused_even_with_output_cap():
    with pytest.raises(FitRefused):
        fit_into(COMPRESS, "quota", room=300, prompt_tokens=2_048, output_tokens=256, choices=1)


def test_apply_only_lowers_budgets_and_turns_compression_on():
    policy = Policy(
        name="p",
        max_input_tokens=2_048,
        reserve_output_tokens=256,
        compression_enabled=False,
        documents={"max_tokens": 1_200},
    )
    fitted = Fit("quota", budget=700, output_tokens=100, would_have_needed=2_304).apply(policy)
    assert (fitted.max_input_tokens, fitted.documents.max_tokens, fitted.reserve_output_tokens) == (
        700,
        700,
        100,
    )
    assert fitted.compression_enabled
    roomy = Fit("quota", budget=4_000, output_tokens=1_000, would_have_needed=6_000).apply(policy)
    assert (roomy.max_input_tokens, roomy.documents.max_tokens, roomy.reserve_output_tokens) == (
        2_048,
        1_200,
        256,
    )


def test_the_default_is_todays_refusal():
    fit = Policy(name="p").fit
    assert [fit.action(limit) for limit in ("quota", "context_window", "max_input_tokens")] == ["reject"] * 3
