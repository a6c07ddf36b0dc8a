"""Sentence scoring and budgeted selection of the passages block.

A sentence's relevance is ctxgate.compression.learned's fitted combination of its features (extraction.scorer
"learned"), or fuses its embedding similarity to the question, IDF-weighted lexical overlap with the
question and its passage's rerank score (ctxgate.compression.scoring; "fused", optionally with the
query-expansion hop of ctxgate.compression.multihop.expand). The knapsack picks the most relevant set within
the block budget; sentences are then emitted in their original order, passage titles kept. Rule: the
rendered block never exceeds its budget.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ctxgate.compression.counting import CachedCounter
from ctxgate.compression.knapsack import knapsack
from ctxgate.compression.learned import learned_scores
from ctxgate.compression.multihop.expand import MULTI_HOP_PASSAGE_WEIGHT, boost_bridge_passages, expand_query
from ctxgate.compression.rendering import passage_header_cost, render_context
from ctxgate.compression.rerank import minmax
from ctxgate.compression.scoring import (
    EMBEDDING_WEIGHT,
    LEXICAL_WEIGHT,
    SentenceUnit,
    lexical_overlap,
    store_sentence_scores,
    values_from_scores,
)
from ctxgate.compression.sentence_features import sentence_features
from ctxgate.compression.state import Passage
from ctxgate.policies.schema import ExtractionPolicy

# Single-hop questions: the sentence lives in a top-ranked passage, so its rank weighs as much as
# the sentence's own match (multi-hop: ctxgate.compression.multihop.expand.MULTI_HOP_PASSAGE_WEIGHT).
PASSAGE_WEIGHT = 1.0


def sentence_units(passages: list[Passage]) -> list[SentenceUnit]:
    """Every live sentence of the passages, unscored."""
    units: list[SentenceUnit] = []
    for passage_index, passage in enumerate(passages):
        for sentence_index, sentence in enumerate(passage.sentences or []):
            if sentence_index not in passage.removed_sentences:
                units.append(SentenceUnit(passage_index, sentence_index, sentence, 0.0))
    return units


def embed_units(
    units: list[SentenceUnit],
    passages: list[Passage],
    dimension: int,
    embed: Callable[[list[str]], np.ndarray],
) -> tuple[np.ndarray, list[int]]:
    """The units' vectors and the positions embedded: only the pre-filter's candidates are; the
    others keep a zero vector (semantic 0)."""
    wanted = [
        position
        for position, unit in enumerate(units)
        if passages[unit.passage_index].embed_sentences is None
        or unit.sentence_index in passages[unit.passage_index].embed_sentences
    ]
    vectors = np.zeros((len(units), dimension), dtype=np.float32)
    if wanted:
        vectors[wanted] = embed([units[i].text for i in wanted])
    return vectors, wanted


def unit_features(
    question: str,
    question_vector: np.ndarray,
    passages: list[Passage],
    units: list[SentenceUnit],
    vectors: np.ndarray,
    wanted: list[int],
) -> np.ndarray:
    """ctxgate.compression.sentence_features' rows for the units."""
    lexical = lexical_overlap(question, [unit.text for unit in units])
    positions = [(unit.passage_index, unit.sentence_index, unit.text) for unit in units]
    return sentence_features(question, question_vector, passages, positions, vectors, wanted, lexical)


def score_sentences(
    question: str,
    question_vector: np.ndarray,
    passages: list[Passage],
    embed: Callable[[list[str]], np.ndarray],
    policy: ExtractionPolicy,
) -> list[SentenceUnit]:
    expand = policy.expand_query
    units = sentence_units(passages)
    if not units:
        return units
    vectors, wanted = embed_units(units, passages, len(question_vector), embed)
    if policy.scorer == "learned":
        positions = [(unit.passage_index, unit.sentence_index, unit.text) for unit in units]
        features = unit_features(question, question_vector, passages, units, vectors, wanted)
        scores = learned_scores(question, passages, positions, features)
        for unit, score in zip(units, scores, strict=True):
            unit.score = float(score)
    else:
        fuse_scores(question, question_vector, passages, units, vectors, wanted, expand)
    if expand and len(units) > 1:
        expand_query(question, units, passages, vectors, wanted, embed)
    if expand and len(passages) > 1:
        boost_bridge_passages(units, passages)
    store_sentence_scores(units, passages)
    return units


def fuse_scores(
    question: str,
    question_vector: np.ndarray,
    passages: list[Passage],
    units: list[SentenceUnit],
    vectors: np.ndarray,
    wanted: list[int],
    expand: bool,
) -> None:
    """The hand-weighted fusion (extraction.scorer "fused"): embedding, lexical and passage terms."""
    semantic = np.zeros(len(units))
    if wanted:
        semantic[wanted] = minmax((vectors[wanted] @ question_vector).astype(np.float64))
    lexical = lexical_overlap(question, [unit.text for unit in units])
    passage_scores = minmax(np.array([p.score for p in passages], dtype=np.float64))
    passage_weight = MULTI_HOP_PASSAGE_WEIGHT if expand else PASSAGE_WEIGHT
    for position, unit in enumerate(units):
        unit.score = float(
            EMBEDDING_WEIGHT * semantic[position]
            + LEXICAL_WEIGHT * lexical[position]
            + passage_weight * passage_scores[unit.passage_index]
        )


def select_sentences(
    units: list[SentenceUnit],
    passages: list[Passage],
    budget: int,
    counter: CachedCounter,
    policy: ExtractionPolicy,
) -> None:
    """Set `kept_sentences` on every passage so the rendered block fits `budget` tokens."""
    for passage in passages:
        passage.kept_sentences = []
    if budget <= 0 or not units:
        return
    values = values_from_scores(np.array([unit.score for unit in units]))
    costs = counter.count_many([unit.text for unit in units])
    for unit, value, cost in zip(units, values, costs, strict=True):
        unit.value, unit.cost = float(value), cost + 1  # +1: the joining space
    headers = [
        passage_header_cost(counter.count, min(i + 1, 99), p, policy.keep_titles)
        for i, p in enumerate(passages)
    ]

    values_list = [unit.value for unit in units]
    costs_list = [unit.cost for unit in units]
    reserve = 0
    chosen: list[int] = []
    for _ in range(4):
        chosen = knapsack(values_list, costs_list, budget - reserve)
        used_passages = {units[i].passage_index for i in chosen}
        needed = sum(units[i].cost for i in chosen) + sum(headers[p] for p in used_passages)
        if needed <= budget:
            break
        reserve = sum(headers[p] for p in used_passages)
    chosen_set = set(chosen)
    spent = sum(units[i].cost for i in chosen) + sum(
        headers[p] for p in {units[i].passage_index for i in chosen}
    )

    # Fill what the knapsack left: neighbours of chosen sentences first (coherence), then by value.
    position_of = {(u.passage_index, u.sentence_index): i for i, u in enumerate(units)}
    candidates: list[int] = []
    if policy.neighbours:
        for i in sorted(chosen, key=lambda i: -units[i].value):
            for offset in range(1, policy.neighbours + 1):
                for sentence_index in (units[i].sentence_index - offset, units[i].sentence_index + offset):
                    neighbour = position_of.get((units[i].passage_index, sentence_index))
                    if neighbour is not None:
                        candidates.append(neighbour)
    candidates += sorted(range(len(units)), key=lambda i: -units[i].value)
    used_passages = {units[i].passage_index for i in chosen_set}
    for i in candidates:
        if i in chosen_set:
            continue
        extra = units[i].cost + (
            0 if units[i].passage_index in used_passages else headers[units[i].passage_index]
        )
        if spent + extra <= budget:
            chosen_set.add(i)
            used_passages.add(units[i].passage_index)
            spent += extra

    for i in chosen_set:
        passages[units[i].passage_index].kept_sentences.append(units[i].sentence_index)
    trim_block_to_budget(passages, budget, counter, policy)


def trim_block_to_budget(
    passages: list[Passage], budget: int, counter: CachedCounter, policy: ExtractionPolicy
) -> None:
    """Exact check on the rendered block; drop the least valuable sentence until it fits."""
    while True:
        if counter.count(render_context(passages, policy.keep_titles)) <= budget:
            return
        if drop_lowest_sentence(passages) is None:
            return


def drop_lowest_sentence(passages: list[Passage]) -> str | None:
    """Remove the least relevant kept sentence (or unsplit passage); return its text."""
    lowest: tuple[float, int, int] | None = None
    for passage_index, passage in enumerate(passages):
        if passage.sentences is None:
            if passage.kept_sentences is None:
                # Whole passage without sentence split: its score stands for it.
                candidate = (passage.score, passage_index, -1)
                if lowest is None or candidate < lowest:
                    lowest = candidate
            continue
        kept = passage.kept_sentences
        if kept is None:
            kept = [i for i in range(len(passage.sentences)) if i not in passage.removed_sentences]
        scores = passage.sentence_scores or [passage.score] * len(passage.sentences)
        for sentence_index in kept:
            candidate = (scores[sentence_index], passage_index, sentence_index)
            if lowest is None or candidate < lowest:
                lowest = candidate
    if lowest is None:
        return None
    _, passage_index, sentence_index = lowest
    passage = passages[passage_index]
    if sentence_index < 0:
        passage.sentences = [passage.text]
        passage.kept_sentences = []
        return passage.text
    if passage.kept_sentences is None:
        passage.kept_sentences = [
            i for i in range(len(passage.sentences or [])) if i not in passage.removed_sentences
        ]
    passage.kept_sentences.remove(sentence_index)
    return passage.sentences[sentence_index]
