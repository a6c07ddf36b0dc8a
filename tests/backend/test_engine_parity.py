"""Greedy output must equal Hugging Face transformers' greedy output token for token."""

from __future__ import annotations

import pytest

from ctxgate.backend.engine.api import SamplingParams
from tests.backend.engine_fixtures import PARITY_MAX_TOKENS

GREEDY = SamplingParams(max_tokens=PARITY_MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("attention_backend", ["reference", "cpu_batched"])
def test_each_prompt_alone_matches_hf(make_engine, parity_prompts, hf_greedy_reference, attention_backend):
    engine = make_engine(attention_backend=attention_backend)
    for prompt, expected in zip(parity_prompts, hf_greedy_reference, strict=True):
        assert engine.generate([prompt], GREEDY) == [expected]


@pytest.mark.parametrize("attention_backend", ["reference", "cpu_batched"])
def test_all_prompts_in_one_batch_match_hf(
    make_engine, parity_prompts, hf_greedy_reference, attention_backend
):
    engine = make_engine(attention_backend=attention_backend)
    assert engine.generate(parity_prompts, GREEDY) == hf_greedy_reference
    assert engine.stats().num_kv_blocks_free == engine.stats().num_kv_blocks_total


def test_small_prefill_chunks_match_hf(make_engine, parity_prompts, hf_greedy_reference):
    engine = make_engine(max_num_batched_tokens=16)
    assert engine.generate(parity_prompts, GREEDY) == hf_greedy_reference
    assert engine.stats().last_step_num_tokens <= 16


def test_preemption_under_a_tiny_kv_pool_matches_hf(make_engine, parity_prompts, hf_greedy_reference):
    longest = max(len(p) for p in parity_prompts) + PARITY_MAX_TOKENS
    num_blocks = -(-longest // 16) + 2  # room for the longest sequence, not for all of them
    engine = make_engine(num_kv_blocks=num_blocks, enable_prefix_caching=False)
    assert engine.generate(parity_prompts, GREEDY) == hf_greedy_reference
    assert engine.stats().num_preemptions > 0
    assert engine.stats().num_kv_blocks_free == num_blocks


def test_preemption_with_prefix_caching_matches_hf(make_engine, parity_prompts, hf_greedy_reference):
    longest = max(len(p) for p in parity_prompts) + PARITY_MAX_TOKENS
    engine = make_engine(num_kv_blocks=-(-longest // 16) + 2, max_num_batched_tokens=32)
    assert engine.generate(parity_prompts, GREEDY) == hf_greedy_reference
    assert engine.stats().num_preemptions > 0
