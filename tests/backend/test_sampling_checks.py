"""Admission: every sampling field the step reads is checked against the model when a request is added.

Each of these values, unchecked, made the batched step raise (and, before step isolation, failed
every tenant's running request): the engine refuses them with a 400 naming the field, or, where the
meaning is unchanged, stores them in a form no tensor op can overflow on.
"""

from __future__ import annotations

import math

import pytest

from ctxgate.backend.engine.api import EngineError, GenerationRequest, SamplingParams
from ctxgate.backend.engine.guided import GuideSpec, compiler_for
from ctxgate.backend.engine.sampling_checks import MAX_STOP_TOKEN_IDS, SamplingParamError, admitted

VOCAB = 49152  # SmolLM2's
INT64_MAX = 2**63 - 1

REFUSED = [
    ({"stop_token_ids": [1_000_000_000], "min_tokens": 5}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ({"logit_bias": {2**64: 1.0}}, "logit_bias"),
    ({"logit_bias": {7: math.nan}}, "logit_bias"),
    ({"logit_bias": {7: math.inf}}, "logit_bias"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 10**400}, "temperature"),  # an int too big for a float
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"min_p": math.inf}, "min_p"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": -math.inf}, "frequency_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**70}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": 9}, "n"),  # over the engine's max_num_seqs (8 here)
    ({"logprobs": 21}, "top_logprobs"),
    ({"logprobs": -1}, "top_logprobs"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": [b"x"]}, "stop"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[f"{p}-{i}" for i, (_, p) in enumerate(REFUSED)])
def test_invalid_field_is_refused_by_name(fields, param):
    with pytest.raises(SamplingParamError) as refused:
        admitted(SamplingParams(**fields), VOCAB, max_num_seqs=8)
    assert refused.value.param == param
    assert param in str(refused.value)


ACCEPTED = [
    {"stop_token_ids": [0, VOCAB - 1], "min_tokens": 5},
    {"logit_bias": {0: -100.0, VOCAB - 1: 100.0}},
    {"seed": -(2**63)},
    {"seed": INT64_MAX},
    {"max_tokens": INT64_MAX, "min_tokens": INT64_MAX},  # the engine clamps it to the context
    {"temperature": 1e30},
    {"n": 8, "logprobs": 20},
]


@pytest.mark.parametrize("fields", ACCEPTED)
def test_edge_values_are_admitted(fields):
    assert admitted(SamplingParams(**fields), VOCAB, max_num_seqs=8) is not None


@pytest.mark.parametrize("top_k", [VOCAB, VOCAB + 1, 2**63, 2**200])
def test_top_k_at_or_past_the_vocabulary_is_off(top_k):
    """top_k >= vocab keeps every token: stored as 0 (off), so no tensor ever holds the huge value."""
    params = SamplingParams(top_k=top_k)
    assert admitted(params, VOCAB, max_num_seqs=8).top_k == 0
    assert params.top_k == top_k  # the caller's object is not changed
    assert admitted(SamplingParams(top_k=VOCAB - 1), VOCAB, max_num_seqs=8).top_k == VOCAB - 1


def test_a_grammar_for_a_bigger_vocabulary_is_refused(tokenizer):
    guide = compiler_for(tokenizer).compile_now(GuideSpec.choice(["a"], "guided_choice"))
    admitted(SamplingParams(guide=guide), VOCAB, max_num_seqs=8)
    with pytest.raises(SamplingParamError) as refused:
        admitted(SamplingParams(guide=guide), VOCAB - 1, max_num_seqs=8)
    assert refused.value.param == "response_format"


def test_model_free_checks_run_without_a_vocabulary():
    """The gateway validates before it knows the model's vocabulary: int64 and float checks hold."""
    SamplingParams(stop_token_ids=[10**9]).validate()  # in int64: only the engine can refuse it
    with pytest.raises(SamplingParamError) as refused:
        SamplingParams(stop_token_ids=[2**63]).validate()
    assert refused.value.param == "stop_token_ids"
    with pytest.raises(SamplingParamError):
        SamplingParams(temperature=math.nan).validate()


# ---- through the real engine -------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_num_seqs=8)


PROMPT = [1, 504, 3458, 282, 4649, 314]


def test_the_engine_refuses_with_a_400_naming_the_field(engine):
    request = GenerationRequest(
        "bad-stop", PROMPT, SamplingParams(stop_token_ids=[1_000_000_000], min_tokens=5)
    )
    with pytest.raises(EngineError) as refused:
        engine.add_request(request)
    assert (refused.value.status_code, refused.value.param) == (400, "stop_token_ids")
    assert "bad-stop" not in engine.sequences and not engine.has_unfinished_requests()


def test_a_huge_top_k_samples_as_no_top_k(engine):
    plain, huge = engine.generate(
        [PROMPT, PROMPT],
        [SamplingParams(max_tokens=6, seed=3, top_k=0), SamplingParams(max_tokens=6, seed=3, top_k=2**63)],
    )
    assert huge == plain


def test_a_grammar_that_ends_before_min_tokens_ends_there(engine, tokenizer):
    """guided_choice ["a"] with min_tokens 12: the grammar's end wins (the answer is "a"), sampled or
    greedy; before, the sampled row had no token left to draw and the step raised."""
    guide = compiler_for(tokenizer).compile_now(GuideSpec.choice(["a"], "guided_choice"))
    for temperature in (1.0, 0.0):
        [tokens] = engine.generate(
            [PROMPT], SamplingParams(max_tokens=16, min_tokens=12, guide=guide, temperature=temperature)
        )
        assert tokenizer.decode(tokens, skip_special_tokens=True) == "a"
        assert tokens[-1] in tokenizer.eos_token_ids


def test_min_tokens_still_holds_where_the_grammar_allows_more(engine, tokenizer):
    guide = compiler_for(tokenizer).compile_now(GuideSpec("regex", "[a-z]{1,20}", "guided_regex"))
    [tokens] = engine.generate(
        [PROMPT], SamplingParams(max_tokens=16, min_tokens=4, guide=guide, temperature=0)
    )
    assert len(tokens) >= 4


def test_a_seed_anywhere_in_int64_runs_every_choice(engine):
    """Choice i draws from seed + i (mod 2**64): the largest seed with n > 1 does not overflow."""
    [tokens] = engine.generate([PROMPT], SamplingParams(max_tokens=3, seed=INT64_MAX, n=3))
    assert len(tokens) == 9
