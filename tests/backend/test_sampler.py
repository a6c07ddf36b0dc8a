"""Unit tests of next-token sampling: the greedy rules, top-k / top-p masking, seeded generators."""

from __future__ import annotations

import math

import pytest
import torch

from ctxgate.backend.engine.api import SamplingParams
from ctxgate.backend.engine.sampler import GREEDY_TEMPERATURE, apply_top_k_top_p, sample
from ctxgate.backend.engine.sequence import Sequence

# Four tokens with probabilities 0.5, 0.3, 0.15, 0.05 (as logits), deliberately not in sorted order.
PROBS = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}
LOGITS = torch.tensor([math.log(PROBS[token]) for token in range(4)])
TOP_TOKEN = 2


def make_seq(seed: int | None = None, **sampling: float) -> Sequence:
    """A sequence as the engine builds it: a seeded request gets its own generator."""
    seq = Sequence(
        request_id="r",
        prompt_token_ids=[1],
        sampling=SamplingParams(**sampling),
        max_tokens=4,
        arrival_order=0,
    )
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    return seq


def draws(seq: Sequence, logits: torch.Tensor, count: int) -> list[int]:
    return [sample(logits.unsqueeze(0), [seq])[0] for _ in range(count)]


def test_no_sequences_sample_nothing():
    assert sample(torch.empty(0, 4), []) == []


@pytest.mark.parametrize("temperature", [0.0, GREEDY_TEMPERATURE / 10, 1e-45])
def test_temperature_zero_or_tiny_is_argmax_per_row(temperature):
    rows = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0], [-2.0, -3.0, -1.5]])
    sequences = [make_seq(temperature=temperature) for _ in rows]
    # A tiny temperature would overflow logits / temperature into NaN if it were not greedy.
    assert sample(rows, sequences) == [1, 0, 2]


def test_top_k_one_is_greedy_at_any_temperature():
    assert set(draws(make_seq(seed=0, temperature=5.0, top_k=1), LOGITS, 50)) == {TOP_TOKEN}


@pytest.mark.parametrize("top_p", [1e-12, 1e-50])  # 1e-50 is 0 in float32
def test_a_tiny_top_p_keeps_only_the_top_token(top_p):
    # top_p is never allowed to mask everything: the most likely token always survives.
    masked = apply_top_k_top_p(LOGITS, top_k=0, top_p=top_p)
    assert torch.isfinite(masked).tolist() == [token == TOP_TOKEN for token in range(4)]
    assert set(draws(make_seq(seed=0, temperature=1.0, top_p=top_p), LOGITS, 50)) == {TOP_TOKEN}


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, {2}), (0.75, {2, 0}), (0.85, {2, 0, 3}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_prefix_reaching_it(top_p, kept):
    # Sorted probabilities 0.5, 0.3, 0.15, 0.05: a token stays while the ones above it sum to < top_p.
    masked = apply_top_k_top_p(LOGITS, top_k=0, top_p=top_p)
    assert {token for token in range(4) if torch.isfinite(masked[token])} == kept
    assert torch.equal(masked[list(kept)], LOGITS[list(kept)])  # survivors keep their logits


@pytest.mark.parametrize(
    ("top_k", "kept"), [(2, {2, 0}), (3, {2, 0, 3}), (0, {0, 1, 2, 3}), (9, {0, 1, 2, 3})]
)
def test_top_k_keeps_the_k_largest(top_k, kept):
    masked = apply_top_k_top_p(LOGITS, top_k=top_k, top_p=1.0)
    assert {token for token in range(4) if torch.isfinite(masked[token])} == kept


def test_top_k_and_top_p_combine_and_sampling_stays_inside_the_mask():
    seq = make_seq(seed=3, temperature=1.0, top_k=3, top_p=0.75)
    assert set(draws(seq, LOGITS, 200)) == {2, 0}


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    flat = torch.zeros(1000)  # uniform: two seeds agreeing on 20 draws would be a broken generator

    def run(seed: int) -> list[int]:
        return draws(make_seq(seed=seed, temperature=1.0), flat, 20)

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_rows_sample_independently_with_their_own_parameters():
    rows = torch.stack([LOGITS, LOGITS])
    sequences = [make_seq(temperature=0.0), make_seq(seed=1, temperature=1.0, top_k=2)]
    for _ in range(30):
        greedy, sampled = sample(rows, sequences)
        assert greedy == TOP_TOKEN and sampled in {2, 0}


def test_min_tokens_keeps_eos_and_stop_ids_out_until_reached():
    """vLLM's min_tokens: below it, EOS (unless ignored) and stop_token_ids cannot be sampled."""
    eos = TOP_TOKEN  # the argmax is the EOS token
    seq = make_seq(temperature=0.0, min_tokens=2, stop_token_ids=[0])
    assert sample(LOGITS.unsqueeze(0), [seq], eos_token_ids=[eos]) == [3]  # neither EOS (2) nor stop id (0)
    seq.token_ids += [3, 3]  # two output tokens: the minimum is reached
    assert sample(LOGITS.unsqueeze(0), [seq], eos_token_ids=[eos]) == [eos]
    ignoring = make_seq(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample(LOGITS.unsqueeze(0), [ignoring], eos_token_ids=[eos]) == [eos]  # EOS does not end it anyway
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3).validate()


def test_penalties_batched_per_row():
    # Row 0: token 2 was generated twice; frequency 1 and presence 1 take 3 off its logit. Row 1 has
    # no penalties and is untouched. Row 2: repetition 2 halves the positive logit of prompt token 1.
    from ctxgate.backend.engine.sampler import apply_penalties

    penalised = make_seq(frequency_penalty=1.0, presence_penalty=1.0)
    penalised.token_ids += [2, 2]
    plain = make_seq()
    repeated = make_seq(repetition_penalty=2.0)
    logits = torch.tensor([[1.0, 1.0, 4.0, 1.0]] * 3)
    out = apply_penalties(logits, [penalised, plain, repeated])
    assert out[0].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert out[1].tolist() == logits[1].tolist()
    assert out[2].tolist() == [1.0, 0.5, 4.0, 1.0]


def test_min_p_drops_tokens_below_its_share_of_the_top():
    # The top token has 0.5: min_p 0.7 keeps it alone (0.3 < 0.35), min_p 0.5 keeps token 0 too (0.3 >= 0.25).
    seq = make_seq(seed=0, temperature=1.0, min_p=0.7)
    assert set(draws(seq, LOGITS, 30)) == {TOP_TOKEN}
    loose = make_seq(seed=0, temperature=1.0, min_p=0.5)
    assert set(draws(loose, LOGITS, 60)) == {TOP_TOKEN, 0}


def test_logprobs_are_the_raw_distribution_with_the_top_alternatives():
    from ctxgate.backend.engine.sampler import sample_tokens

    seq = make_seq(temperature=0, logprobs=2, logit_bias={1: 50.0})
    [token] = sample_tokens(LOGITS.unsqueeze(0), [seq])
    assert token.token_id == 1  # the bias picked it ...
    assert token.logprob.logprob == pytest.approx(math.log(0.05), abs=1e-5)  # ... its raw logprob is reported
    assert [t for t, _ in token.logprob.top] == [TOP_TOKEN, 0]
