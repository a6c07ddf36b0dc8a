"""Cheap lexical pre-filter: which sentences are worth an embedding.

Embedding every sentence dominates compression time on a cold cache, yet the block budget is a
fraction of the input, so most sentences can never be sent. Sentences are ranked by IDF-weighted
overlap with the question plus their passage's BM25 score, and only the best ones, worth a multiple
of the budget in (estimated) tokens, are embedded; the rest keep their lexical score alone.
"""

from __future__ import annotations

import numpy as np

from compression.rerank import bm25_scores, minmax, passage_text_for_scoring
from compression.state import Passage
from policies.schema import DEFAULT_EMBED_BUDGET_MULTIPLE, DEFAULT_EMBED_MIN_SHARE

# Embedded text ~ a multiple of the budget (or a share of the input, whichever is larger): a policy's
# `documents.embed_budget_multiple` / `embed_min_share`, whose defaults (policies/schema.py) were
# set from `ctxgate eval retention` over both dev sets (answer retained, NQ rag-default / HotpotQA
# rag-multihop / HotpotQA rag-default): 1.5x / 0.3: 0.987 / 0.932 / -; 0.8x / 0.2: 0.987 / 0.956 /
# 0.981; 0.5x / 0.1: 0.987 / 0.961 / 0.981; 0.4x / 0.1: 0.987 / 0.956 / 0.981; 0.3x / 0.05: 0.987 /
# 0.956 / 0.985; 0.2x / 0.05: 0.990 / 0.951 / 0.990; nothing embedded: 0.950 / 0.903 / 0.956.
# Flat from 0.2x to 0.8x, so the middle of that range: a lexically chosen candidate set scores as
# well as a wider one whose weakest members get an embedding score too, and the model call (most of
# a first sight's time) holds ~0.6x the word pieces of 0.8x / 0.2's.
# Re-measured 2026-12-04 (same three columns): 0.4x / 0.1 0.987 / 0.956 / 0.990, 0.3x / 0.05 0.980 /
# 0.942 / 0.985, 0.2x / 0.05 0.977 / 0.956 / 0.976 with ~0.73x the word pieces: ~10 ms less engine
# time a cold request, and `bench e2e`'s TTFT P95 ratio to ideal 1.07 against 1.14 pooled over three
# runs each (eval/reports/embed-allowance-2026-12-04/). Offered as the rag-fast policy.
PASSAGE_WEIGHT = 0.5  # how much a sentence inherits from its passage's lexical match
CHARS_PER_TOKEN = 4.0  # estimate only: the selection does not need exact counts


def estimated_tokens(text: str) -> float:
    return len(text) / CHARS_PER_TOKEN + 1


def mark_embedding_candidates(question: str, passages: list[Passage], budget_tokens: int,
                              budget_multiple: float = DEFAULT_EMBED_BUDGET_MULTIPLE,
                              min_share: float = DEFAULT_EMBED_MIN_SHARE) -> int:
    """Set `embed_sentences` on every passage; return how many sentences were left out. The
    allowance is `budget_multiple` x the budget or `min_share` of the input, whichever is larger
    (a policy's `documents.embed_budget_multiple` / `embed_min_share`)."""
    from compression.extraction import lexical_overlap

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
