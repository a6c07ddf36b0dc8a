"""Next-token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from backend.sequence import Sequence

GREEDY_TEMPERATURE = 1e-5


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k and outside the top-p nucleus of a 1-D logits row."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth_value = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_value, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the top token always stays).
        remove_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        remove_sorted[0] = False  # even when top_p underflows to 0 in float32
        remove = torch.zeros_like(remove_sorted).scatter(0, sorted_indices, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sample(logits: torch.Tensor, sequences: list[Sequence], eos_token_ids: Iterable[int] = ()) -> list[int]:
    """One token id per row of float32 `logits` ([len(sequences), vocab]).

    Everything runs on the logits' device (a sequence's seeded generator lives there too); the
    chosen ids cross to the host once per step, in the final `.tolist()`.
    """
    if not sequences:
        return []
    logits = suppress_early_stops(logits, sequences, tuple(eos_token_ids))
    token_ids = torch.argmax(logits, dim=-1)
    rows = [row for row, seq in enumerate(sequences) if not _is_greedy(seq)]
    if rows:
        draws = torch.cat([_draw(logits[row], sequences[row]) for row in rows])
        token_ids = token_ids.index_copy(0, torch.tensor(rows, device=logits.device), draws)
    return token_ids.tolist()


def suppress_early_stops(logits: torch.Tensor, sequences: list[Sequence], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """min_tokens: a sequence with fewer output tokens cannot end on EOS (unless it ignores EOS
    anyway) or on one of its stop_token_ids, so those logits are -inf for its row."""
    rows = [(row, seq) for row, seq in enumerate(sequences) if seq.num_output_tokens < seq.sampling.min_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    for row, seq in rows:
        banned = list(seq.sampling.stop_token_ids) + ([] if seq.sampling.ignore_eos else list(eos_token_ids))
        if banned:
            logits[row, banned] = float("-inf")
    return logits


def _is_greedy(seq: Sequence) -> bool:
    params = seq.sampling
    # A temperature this small overflows logits / temperature into inf (NaN probabilities): greedy.
    return params.temperature < GREEDY_TEMPERATURE or params.top_k == 1


def _draw(row_logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """A [1] tensor holding the token drawn for `seq` from its row of logits."""
    params = seq.sampling
    scaled = apply_top_k_top_p(row_logits.float() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=seq.generator)
