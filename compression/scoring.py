"""A sentence's relevance to a query, the primitives every scorer of the passages block shares.

Rule: relevance fuses embedding similarity and IDF-weighted lexical overlap (plus, in the first
hop, the passage's rerank score); a unit's knapsack value is exp((score - best) / temperature), so
one strong sentence beats several weak ones of the same total cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ctxgate.compression.state import Passage
from ctxgate.compression.text import content_words

# A sentence's relevance mixes its embedding similarity and its lexical overlap with the question at
# these weights (plus its passage's rerank score, weighted where it is combined).
EMBEDDING_WEIGHT = 0.45
LEXICAL_WEIGHT = 0.35
# Sharpness of value = exp((score - best) / temperature): the knapsack should prefer one strong
# sentence over several weak ones of the same total cost.
VALUE_TEMPERATURE = 0.12


def lexical_overlap(question: str, texts: list[str]) -> np.ndarray:
    """Share of the question's content words (IDF-weighted over `texts`) that each text contains."""
    question_words = content_words(question)
    if not question_words or not texts:
        return np.zeros(len(texts))
    text_words = [content_words(text) for text in texts]
    total = len(texts)
    weights = {}
    # Sorted: a set of strings iterates in a per-process order, and float sums taken in another
    # order can differ in the last bit, enough to flip a tie (prompts must not depend on the run).
    for word in sorted(question_words):
        document_frequency = sum(1 for words in text_words if word in words)
        weights[word] = math.log(1 + total / (1 + document_frequency))
    norm = sum(weights.values()) or 1.0
    return np.array([sum(w for word, w in weights.items() if word in words) / norm for words in text_words])


def values_from_scores(scores: np.ndarray) -> np.ndarray:
    if scores.size == 0:
        return scores
    return np.exp((scores - scores.max()) / VALUE_TEMPERATURE)


@dataclass
class SentenceUnit:
    passage_index: int
    sentence_index: int
    text: str
    score: float
    value: float = 0.0
    cost: int = 0


def store_sentence_scores(units: list[SentenceUnit], passages: list[Passage]) -> None:
    """Each passage keeps its sentences' scores: the fit stage trims by them."""
    for passage_index, passage in enumerate(passages):
        scores = [0.0] * len(passage.sentences or [])
        for unit in units:
            if unit.passage_index == passage_index:
                scores[unit.sentence_index] = unit.score
        passage.sentence_scores = scores
