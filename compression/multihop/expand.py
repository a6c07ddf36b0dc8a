"""The query-expansion hop (extraction.expand_query, the rag-multihop policy).

Rule: the best first-hop sentence (with its passage title) completes the question, and every other
passage's sentences are scored against that too, a little below a direct match; a passage a
best first-hop passage names by title (or that names it) has its opening sentences lifted just
below the best sentence. Passage rank weighs less, since a bridge passage ranks low by nature.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ctxgate.compression.multihop.names import mentions, title_core
from ctxgate.compression.rerank import minmax
from ctxgate.compression.scoring import EMBEDDING_WEIGHT, LEXICAL_WEIGHT, SentenceUnit, lexical_overlap
from ctxgate.compression.state import Passage

# The passage term's weight when the question may need a second hop (1.0 otherwise).
MULTI_HOP_PASSAGE_WEIGHT = 0.20
# How many first-hop passages are read for titles, and how many opening sentences of a bridge
# passage are lifted.
BRIDGE_SOURCES = 1
REVERSE_SOURCES = 1
BRIDGE_SENTENCES = 3
FEEDBACK_WEIGHT = 0.9  # a second-hop match counts a little less than a direct one
# A bridge passage's k-th opening sentence scores (k + 1) x this below the best sentence.
BRIDGE_GAP = 0.05


def expand_query(
    question: str,
    units: list[SentenceUnit],
    passages: list[Passage],
    vectors: np.ndarray,
    wanted: list[int],
    embed: Callable[[list[str]], np.ndarray],
) -> None:
    """Score the other passages' sentences against the question completed with the best first-hop
    sentence and its title; a unit keeps the better of its two scores. `vectors` are the units'
    embeddings (rows in `wanted`; the pre-filter left the others at zero)."""
    best = max(units, key=lambda unit: unit.score)
    title = passages[best.passage_index].title or ""
    expanded = f"{question} {title} {best.text}"
    expanded_vector = embed([expanded])[0]
    semantic2 = np.zeros(len(units))
    if wanted:
        semantic2[wanted] = minmax((vectors[wanted] @ expanded_vector).astype(np.float64))
    lexical2 = lexical_overlap(expanded, [unit.text for unit in units])
    for position, unit in enumerate(units):
        if unit.passage_index == best.passage_index:
            continue
        second = EMBEDDING_WEIGHT * semantic2[position] + LEXICAL_WEIGHT * lexical2[position]
        unit.score = max(unit.score, FEEDBACK_WEIGHT * (second + MULTI_HOP_PASSAGE_WEIGHT))


def boost_bridge_passages(units: list[SentenceUnit], passages: list[Passage]) -> None:
    """Second hop: a passage whose title the best first-hop passages mention is the bridge a
    multi-hop question needs, however little it shares with the question; its opening sentences
    (where an entity is defined) are scored just below the best first-hop sentence."""
    best_of: dict[int, float] = {}
    for unit in units:
        best_of[unit.passage_index] = max(best_of.get(unit.passage_index, 0.0), unit.score)
    hop_sources = sorted(best_of, key=lambda index: -best_of[index])[:BRIDGE_SOURCES]
    source_text = " ".join(passages[index].text.lower() for index in hop_sources)
    top_score = max(best_of.values())
    source_titles = [title_core(passages[index].title or "") for index in hop_sources[:REVERSE_SOURCES]]
    source_titles = [core for core in source_titles if len(core) >= 3]
    bridges = set()
    for index, passage in enumerate(passages):
        if index in hop_sources:
            continue
        core = title_core(passage.title or "")
        # Either a top passage names this one, or this one names a top passage.
        if (len(core) >= 3 and mentions(source_text, core)) or any(
            mentions(passage.text.lower(), title) for title in source_titles
        ):
            bridges.add(index)
    for unit in units:
        if unit.passage_index in bridges and unit.sentence_index < BRIDGE_SENTENCES:
            unit.score = max(unit.score, top_score - BRIDGE_GAP * (1 + unit.sentence_index))
