"""The fit decision (gateway/fit.py): the budget a request over a limit gets, the floor, the output cap."""

from __future__ import annotations

import pytest

from ctxgate.gateway.fit import Fit, FitRefused, Prices, fit_into
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
    limits = ("quota", "spend", "context_window", "max_input_tokens")
    assert [fit.action(limit) for limit in limits] == ["reject"] * 4


# Spend: $1 and $4 per 1,000 prompt and output tokens, in micro-units per token.
SPEND_PRICES = Prices(prompt=1_000, output=4_000)
SPEND = FitPolicy(spend="compress", min_context_tokens=300)


def test_spend_left_buys_the_prompt_what_the_output_leaves_at_the_models_prices():
    # $0.50 left; 8 output tokens take $0.032 of it; the rest buys 468 prompt tokens.
    fit = fit_into(
        SPEND, "spend", 500_000, prompt_tokens=1_024, output_tokens=8, choices=1, prices=SPEND_PRICES
    )
    assert fit == Fit("spend", budget=468, output_tokens=8, would_have_needed=1_032)
    assert fit_into(SPEND, "spend", 2_000_000, 1_024, 8, 1, SPEND_PRICES) is None


def test_spend_output_cap_and_floor_at_the_models_prices():
    # $0.50 left, 256 output tokens ($1.024): the prompt keeps the floor ($0.30), the output what
    # $0.20 buys (50 tokens).
    fit = fit_into(SPEND, "spend", 500_000, 1_024, 256, 1, SPEND_PRICES)
    assert fit is not None and (fit.budget, fit.output_tokens) == (300, 50)
    with pytest.raises(FitRefused) as info:
        fit_into(SPEND, "spend", 301_000, 1_024, 256, 1, SPEND_PRICES)
    assert "spend left (0.301" in str(info.value)


def test_free_prompt_tokens_leave_only_the_output_to_cap():
    free_prompt = Prices(prompt=0, output=4_000)
    fit = fit_into(SPEND, "spend", 100_000, 1_024, 256, 1, free_prompt)
    assert fit is not None and (fit.budget, fit.output_tokens) == (1_024, 25)
