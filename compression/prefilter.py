"""Cheap lexical pre-filter: which sentences are worth an embedding.

Embedding every sentence dominates compression time on a cold cache, yet the block budget is a
fraction of the input, so most sentences can never be sent. Sentences are ranked by IDF-weighted
overlap with the question plus their passage's BM25 score, and only the best ones, worth a multiple
of the budget in (estimated) tokens, are embedded; the rest keep their lexical score alone.
"""

from __future__ import annotations

import numpy as np

from ctxgate.compression.rerank import bm25_scores, minmax, passage_text_for_scoring
from ctxgate.compression.state import Passage
from ctxgate.policies.schema import DEFAULT_EMBED_BUDGET_MULTIPLE, DEFAULT_EMBED_MIN_SHARE

# Embedded text ~ a multiple of the budget (or a share of the input, whichever is larger): a policy's
# `documents.embed_budget_multiple` / `embed_min_share` (defaults in policies/schema.py). Answer
# retention is flat over a wide range of allowances, so the default embeds the smaller middle of it
# (docs/decisions/prefilter-share.md); rag-fast halves it (docs/decisions/rag-fast-allowance.md).
PASSAGE_WEIGHT = 0.5  # how much a sentence inherits from its passage's lexical match
CHARS_PER_TOKEN = 4.0  # estimate only: the selection does not need exact counts


def estimated_tokens(text: str) -> float:
    return len(text) / CHARS_PER_TOKEN + 1


def mark_embedding_candidates(
    question: str,
    passages: list[Passage],
    budget_tokens: int,
    budget_multiple: float = DEFAULT_EMBED_BUDGET_MULTIPLE,
    min_share: float = DEFAULT_EMBED_MIN_SHARE,
) -> int:
    """Set `embed_sentences` on every passage; return how many sentences were left out. The
    allowance is `budget_multiple` x the budget or `min_share` of the input, whichever is larger
    (a policy's `documents.embed_budget_multiple` / `embed_min_share`)."""
    from ctxgate.compression.scoring import lexical_overlap

    units = [
        (passage_index, sentence_index, sentence)
        for passage_index, passage in enumerate(passages)
        for sentence_index, sentence in enumerate(passage.sentences or [passage.text])
        if sentence_index not in passage.removed_sentences
    ]
    total = sum(estimated_tokens(text) for _, _, text in units)
    allowance = max(budget_multiple * budget_tokens, min_share * total)
    for passage in passages:
        passage.embed_sentences = None
    if total <= allowance:
        return 0
    lexical = lexical_overlap(question, [text for _, _, text in units])
    passage_lexical = minmax(bm25_scores(question, [passage_text_for_scoring(p) for p in passages]))
    scores = lexical + PASSAGE_WEIGHT * np.array([passage_lexical[p] for p, _, _ in units])
    chosen: dict[int, set[int]] = {index: set() for index in range(len(passages))}
    spent = 0.0
    for position in np.argsort(-scores, kind="stable"):
        passage_index, sentence_index, text = units[position]
        if spent >= allowance:
            break
        chosen[passage_index].add(sentence_index)
        spent += estimated_tokens(text)
    for passage_index, passage in enumerate(passages):
        passage.embed_sentences = chosen[passage_index]
    return len(units) - sum(len(s) for s in chosen.values())
