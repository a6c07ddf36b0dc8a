"""The bridges the rerank cut keeps: passages below the cut that a multi-hop question needs.

Rule: before sentence scores exist, the live sentences of the best-ranked passages stand in for
the first hop; a bridge they name (compression.multihop.plan) and a passage the question names by
title survive the cut, however low they rank. The extraction decides for good what they keep.
"""

from __future__ import annotations

from collections.abc import Callable

from compression.multihop.plan import first_hop_passage_sentences, named_passages, plan_second_hop
from compression.state import Passage, split_passages

# Passages read for bridge entities before sentence scores exist (the extraction decides for good).
RERANK_HOP_PASSAGES = 2
# Bridges kept past the cut: one more than the extraction follows (keeping a passage is cheap, and
# the extraction's sentence scores choose better than the rerank's passage scores).
RERANK_BRIDGES = 3
# Passages the question names kept past the cut, at most.
RERANK_NAMED = 1


def rerank_bridges(
    question: str, ranked: list[Passage], limit: int, split: Callable[[str], list[str]]
) -> list[Passage]:
    """Passages below the rerank cut (`ranked[limit:]`) that a multi-hop question's first hop names:
    the bridge ranks low by nature (it shares little with the question), so the cut must not drop
    it. `split` splits a passage's text into sentences (the best passages are read by sentence)."""
    if limit >= len(ranked):
        return []
    split_passages(ranked[:RERANK_HOP_PASSAGES], split)
    order = list(range(len(ranked)))
    hop = plan_second_hop(
        question, ranked, first_hop_passage_sentences(ranked, order, RERANK_HOP_PASSAGES),
        max_bridges=RERANK_BRIDGES,
    )
    bridges = [ranked[index] for index in hop.bridges if index >= limit] if hop.triggered else []
    # A passage the question names by title is where the question starts (a first hop of its own,
    # compression.multihop.plan.named_passages), however little else of the question it shares.
    named = [ranked[index] for index in named_passages(question, ranked) if index >= limit]
    return bridges + [p for p in named[:RERANK_NAMED] if p not in bridges]
