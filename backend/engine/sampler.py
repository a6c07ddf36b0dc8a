"""Next-token sampling for one engine step, batched over the step's sequences.

Order: penalties (repetition, frequency, presence), logit bias, the grammar mask, min_tokens, then
greedy argmax or temperature / top-k / top-p / min-p sampling. Each stage is one tensor op
over the rows that ask for it (no Python loop over a vocabulary); only the final draws of rows with
their own seeded generator run one row at a time. Log probabilities are the model's raw ones (before
any of these stages), as vLLM reports them by default.

The request fields these stages read are checked when the request is admitted (ctxgate.backend.engine.sampling_checks),
so a batched step does not raise on them. Should one still raise, `sample_each` samples the rows one
at a time: the rows that fail are the failing requests' own (`RowFailure`, naming the stage's
fields), and the others keep the tokens they would have drawn.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ctxgate.backend.engine.api import TokenLogprob
from ctxgate.backend.engine.guided import apply_bitmask, new_bitmask
from ctxgate.backend.engine.sequence import Sequence

GREEDY_TEMPERATURE = 1e-5


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k and outside the top-p nucleus of a 1-D logits row."""
    return _mask_top_k_top_p(logits.unsqueeze(0), torch.tensor([top_k]), torch.tensor([top_p]))[0]


def _mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows of `logits` with per-row top-k (0: off) and top-p (1: off) applied."""
    vocab = logits.shape[-1]
    if not bool(((top_k > 0) & (top_k < vocab)).any()) and not bool((top_p < 1.0).any()):
        return logits
    sorted_logits, sorted_indices = torch.sort(logits, dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).to(logits.device)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens before it already reach top_p (the top token always stays).
    remove = (probs.cumsum(dim=-1) - probs) >= top_p.to(logits.device).unsqueeze(1)
    remove[:, 0] = False  # even when top_p underflows to 0 in float32
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_indices, sorted_logits)


def sample(logits: torch.Tensor, sequences: list[Sequence], eos_token_ids: Iterable[int] = ()) -> list[int]:
    """One token id per row of float32 `logits` ([len(sequences), vocab])."""
    return [token.token_id for token in sample_tokens(logits, sequences, eos_token_ids)]


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None  # when the sequence's request asked for log probabilities


def sample_tokens(
    logits: torch.Tensor, sequences: list[Sequence], eos_token_ids: Iterable[int] = ()
) -> list[SampledToken]:
    """Sample every row; everything runs on the logits' device and crosses to the host once."""
    if not sequences:
        return []
    raw = logits
    logits = apply_penalties(logits, sequences)
    logits = apply_logit_bias(logits, sequences)
    logits = apply_guides(logits, sequences)
    logits = suppress_early_stops(logits, sequences, tuple(eos_token_ids))
    token_ids = torch.argmax(logits, dim=-1)
    rows = [row for row, seq in enumerate(sequences) if not _is_greedy(seq)]
    if rows:
        token_ids = token_ids.index_copy(
            0, torch.tensor(rows, device=logits.device), _draw(logits[rows], [sequences[row] for row in rows])
        )
    chosen = token_ids.tolist()
    logprobs = token_logprobs(raw, sequences, chosen)
    return [SampledToken(token, logprobs.get(row)) for row, token in enumerate(chosen)]


def apply_penalties(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties."""
    rows = [row for row, seq in enumerate(sequences) if seq.sampling.penalised]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    seqs = [sequences[row] for row in rows]
    outputs = [seq.output_token_ids for seq in seqs]
    longest = max(1, max(map(len, outputs)))
    # Output token ids padded with `vocab` (a column dropped afterwards): one scatter counts them all.
    padded = torch.tensor([ids + [vocab] * (longest - len(ids)) for ids in outputs], device=device)
    counts = torch.zeros(len(rows), vocab + 1, device=device).scatter_add_(
        1, padded, torch.ones(padded.shape, device=device)
    )[:, :vocab]
    params = [seq.sampling for seq in seqs]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    seen = (counts > 0) | torch.stack([_prompt_mask(seq, vocab, device) for seq in seqs])
    picked = logits[rows]
    picked = torch.where(seen, torch.where(picked > 0, picked / repetition, picked * repetition), picked)
    picked = picked - frequency * counts - presence * (counts > 0).float()
    logits = logits.clone()
    logits[rows] = picked
    return logits


def _prompt_mask(seq: Sequence, vocab: int, device: torch.device) -> torch.Tensor:
    if seq.sampling.repetition_penalty == 1.0:
        return torch.zeros(vocab, dtype=torch.bool, device=device)
    if seq.prompt_token_mask is None:  # once per sequence: the prompt does not change
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        mask[torch.tensor(seq.prompt_token_ids, device=device)] = True
        seq.prompt_token_mask = mask
    return seq.prompt_token_mask


def apply_logit_bias(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    entries = [
        (row, token, bias)
        for row, seq in enumerate(sequences)
        for token, bias in seq.sampling.logit_bias.items()
    ]
    if not entries:
        return logits
    rows, tokens, biases = zip(*entries, strict=True)
    device = logits.device
    return logits.index_put(
        (torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
        torch.tensor(biases, device=device, dtype=logits.dtype),
        accumulate=True,
    )


def suppress_early_stops(
    logits: torch.Tensor, sequences: list[Sequence], eos_token_ids: tuple[int, ...]
) -> torch.Tensor:
    """min_tokens: a sequence with fewer output tokens cannot end on EOS (unless it ignores EOS
    anyway) or on one of its stop_token_ids, so those logits are -inf for its row.

    Unless that leaves the row nothing to sample: a grammar that can only end here (a choice shorter
    than min_tokens), or stop ids covering every token the grammar allows. Then the end wins over
    min_tokens, as the grammar is the stronger constraint (and a row of -inf has no token to draw).
    """
    entries = [
        (row, token)
        for row, seq in enumerate(sequences)
        if seq.num_output_tokens < seq.sampling.min_tokens
        for token in list(seq.sampling.stop_token_ids)
        + ([] if seq.sampling.ignore_eos else list(eos_token_ids))
    ]
    if not entries:
        return logits
    rows, tokens = zip(*entries, strict=True)
    suppressed = logits.clone()
    suppressed[list(rows), list(tokens)] = float("-inf")
    touched = sorted(set(rows))
    emptied = torch.isneginf(suppressed[touched]).all(dim=-1, keepdim=True)
    # No host sync: rows left empty take their unsuppressed logits back in one select.
    suppressed[touched] = torch.where(emptied, logits[touched], suppressed[touched])
    return suppressed


def apply_guides(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    """The grammar mask: each guided row keeps only the tokens its grammar allows next."""
    rows = [
        row for row, seq in enumerate(sequences) if seq.matcher is not None and not seq.matcher.terminated
    ]
    if not rows:
        return logits
    bitmask = new_bitmask(len(sequences), logits.shape[-1])
    for row in rows:
        sequences[row].matcher.fill(bitmask, row)  # type: ignore[union-attr]
    logits = logits.clone()
    apply_bitmask(logits, bitmask, rows)
    return logits


def token_logprobs(
    raw: torch.Tensor, sequences: list[Sequence], chosen: list[int]
) -> dict[int, TokenLogprob]:
    """For the rows whose request asked: the chosen token's log probability and the top alternatives."""
    rows = [row for row, seq in enumerate(sequences) if seq.sampling.logprobs is not None]
    if not rows:
        return {}
    logprobs = torch.log_softmax(raw[rows].float(), dim=-1)
    picked = logprobs.gather(1, torch.tensor([chosen[row] for row in rows], device=raw.device).unsqueeze(1))
    widest = max(sequences[row].sampling.logprobs or 0 for row in rows)
    top_values, top_ids = (
        torch.topk(logprobs, widest, dim=-1) if widest else (logprobs[:, :0], logprobs[:, :0])
    )
    picked_list, values, ids = picked.squeeze(1).tolist(), top_values.tolist(), top_ids.long().tolist()
    result = {}
    for i, row in enumerate(rows):
        k = sequences[row].sampling.logprobs or 0
        result[row] = TokenLogprob(
            chosen[row], picked_list[i], tuple(zip(ids[i][:k], values[i][:k], strict=True))
        )
    return result


def _is_greedy(seq: Sequence) -> bool:
    params = seq.sampling
    # A temperature this small overflows logits / temperature into inf (NaN probabilities): greedy.
    return params.temperature < GREEDY_TEMPERATURE or params.top_k == 1


def _draw(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    """One token per row, drawn after temperature, top-k, top-p and min-p (all batched)."""
    device = logits.device
    params = [seq.sampling for seq in sequences]
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    scaled = _mask_top_k_top_p(
        logits.float() / temperature,
        torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params]),
    )
    probs = torch.softmax(scaled, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    seeded = [i for i, seq in enumerate(sequences) if seq.generator is not None]
    if not seeded:
        return torch.multinomial(probs, 1).squeeze(1)
    # A seeded request draws from its own generator, so its tokens do not depend on its neighbours.
    draws = (
        torch.multinomial(probs, 1).squeeze(1)
        if len(seeded) < len(sequences)
        else torch.empty(len(sequences), dtype=torch.long, device=device)
    )
    seeded_probs = probs[seeded]
    # A seeded row's draw advances its generator: all are checked before any draws, so a failing row
    # (what multinomial refuses) cannot leave the others' generators moved on for the per-row retry.
    if not bool((torch.isfinite(seeded_probs).all(dim=-1) & (seeded_probs.sum(dim=-1) > 0)).all()):
        raise ValueError("a seeded row has no valid probabilities to draw from")
    for i in seeded:
        draws[i] = torch.multinomial(probs[i], 1, generator=sequences[i].generator)[0]
    return draws


@dataclass(frozen=True)
class RowFailure:
    """One row that failed to sample on its own: which stage, the request fields it reads, the error."""

    stage: str
    fields: tuple[str, ...]
    error: Exception


_STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("penalties", ("repetition_penalty", "frequency_penalty", "presence_penalty")),
    ("logit bias", ("logit_bias",)),
    ("grammar", ("response_format",)),
    ("min_tokens", ("min_tokens", "stop_token_ids")),
    ("draw", ("temperature", "top_k", "top_p", "min_p", "seed")),
    ("log probabilities", ("logprobs",)),
)


def sample_each(
    logits: torch.Tensor, sequences: list[Sequence], eos_token_ids: Iterable[int] = ()
) -> list[SampledToken | RowFailure]:
    """`sample_tokens` one row at a time (after the batched call raised): a token per good row, a
    RowFailure per row that fails even alone. Costs a pass per row: only for a step that failed."""
    eos = tuple(eos_token_ids)
    results: list[SampledToken | RowFailure] = []
    for row, seq in enumerate(sequences):
        try:
            results.append(sample_tokens(logits[row : row + 1], [seq], eos)[0])
        except Exception as exc:
            results.append(_failing_stage(logits[row : row + 1], seq, eos, exc))
    return results


def _failing_stage(logits: torch.Tensor, seq: Sequence, eos: tuple[int, ...], error: Exception) -> RowFailure:
    """Which stage raises for this row alone: re-run them in order until one does."""
    rows = [seq]
    steps = (
        lambda x: apply_penalties(x, rows),
        lambda x: apply_logit_bias(x, rows),
        lambda x: apply_guides(x, rows),
        lambda x: suppress_early_stops(x, rows, eos),
        lambda x: _draw_checked(x, rows),
    )
    current = logits
    for (stage, fields), step in zip(_STAGES, steps, strict=False):
        try:
            current = step(current)
        except Exception as exc:
            return RowFailure(stage, fields, exc)
    stage, fields = _STAGES[-1]
    return RowFailure(stage, fields, error)


def _draw_checked(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    if not _is_greedy(sequences[0]):
        _draw(logits, sequences)
    return logits
