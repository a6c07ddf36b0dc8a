"""The learned sentence scorer: its features (ctxgate.compression.sentence_features) and their combination
(ctxgate.compression.learned)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ctxgate.compression.learned import HOP_WEIGHTS, WEIGHTS, learned_scores
from ctxgate.compression.scoring import VALUE_TEMPERATURE
from ctxgate.compression.sentence_features import (
    FEATURES,
    HOP_FEATURES,
    answer_type,
    hop_features,
    sentence_features,
    type_match,
)
from ctxgate.compression.state import Passage
from ctxgate.compression.types import Document


def _passage(title: str, text: str, position: int, score: float = 0.0) -> Passage:
    passage = Passage(Document(text=text, id=str(position), title=title), position=position, score=score)
    passage.sentences = [text]
    return passage


def test_weights_cover_every_feature():
    assert len(WEIGHTS) == len(FEATURES) and len(HOP_WEIGHTS) == len(HOP_FEATURES)


@pytest.mark.parametrize(
    ("question", "date", "number", "name"),
    [
        ("when did the first world war end", True, False, False),
        ("In what year was the novel first published?", True, False, False),
        ("how many players are on a rugby team", False, True, False),
        ("who sang i want a hippopotamus for christmas", False, False, True),
        ("what is the capital of france", False, False, False),
    ],
)
def test_answer_type_from_the_wh_word(question, date, number, name):
    kind = answer_type(question)
    assert (kind.date, kind.number, kind.name) == (date, number, name)


def test_type_match_needs_what_the_question_asks_for():
    assert type_match(answer_type("when did it open"), "It opened in March 1921.", []) == 1.0
    assert type_match(answer_type("when did it open"), "It opened to great acclaim.", []) == 0.0
    assert type_match(answer_type("how many seats"), "The hall seats 2,000.", []) == 1.0
    assert type_match(answer_type("who wrote it"), "It was written by him.", []) == 0.0
    assert type_match(answer_type("who wrote it"), "It was written by Mark Twain.", ["mark twain"]) == 1.0


def test_sentence_features_rank_and_link():
    passages = [
        _passage("Green (album)", "Green is an album by Steve Hillage.", 0, score=0.9),
        _passage("Steve Hillage", "Steve Hillage is married to Miquette Giraudy.", 1, score=0.2),
        _passage("Other", "An unrelated passage.", 2, score=0.1),
    ]
    positions = [(i, 0, p.sentences[0]) for i, p in enumerate(passages)]
    vectors = np.zeros((3, 4), dtype=np.float32)
    features = sentence_features(
        "Who is the spouse of the Green performer?",
        np.ones(4, dtype=np.float32),
        passages,
        positions,
        vectors,
        [],
        np.zeros(3),
    )
    column = {name: features[:, i] for i, name in enumerate(FEATURES)}
    assert column["passage_rank"].tolist() == [1.0, 0.5, 1 / 3]
    assert column["lead"].tolist() == [1.0, 1.0, 1.0]
    # The best passage names Steve Hillage: his passage is named by a top passage, and the best
    # passage's sentence names one of the top passages' titles.
    assert column["named_by_top"][1] > 0 and column["named_by_top"][2] == 0
    assert column["names_top"][0] > 0


def test_hop_features_point_from_the_best_sentences():
    passages = [
        _passage("Kiss and Tell (1945 film)", "Kiss and Tell stars Shirley Temple as Corliss Archer.", 0),
        _passage("Shirley Temple", "Shirley Temple was an actress and diplomat.", 1),
        _passage("Town", "A town with a market.", 2),
    ]
    positions = [(i, 0, p.sentences[0]) for i, p in enumerate(passages)]
    first = np.array([2.0, 0.0, 0.0])
    hop = hop_features(
        "What position was held by the woman who portrayed Corliss Archer?", passages, positions, first
    )
    column = {name: hop[:, i] for i, name in enumerate(HOP_FEATURES)}
    assert column["hop_title"].tolist() == [0.0, 1.0, 0.0]
    assert column["hop_lead"].tolist() == [0.0, 1.0, 0.0]
    assert column["hop_name"][1] == 1.0 and column["hop_name"][2] == 0.0


def test_learned_scores_are_log_chances_on_the_knapsack_scale():
    passages = [_passage("A", "One.", 0), _passage("B", "Two.", 1)]
    positions = [(0, 0, "One."), (1, 0, "Two.")]
    features = np.zeros((2, len(FEATURES)))
    features[0, FEATURES.index("lexical")] = 1.0
    weights = [0.0] * len(FEATURES)
    weights[FEATURES.index("lexical")] = 2.0
    scores = learned_scores("q", passages, positions, features, weights, [0.0] * len(HOP_FEATURES))
    assert scores.tolist() == pytest.approx([2.0 * VALUE_TEMPERATURE, 0.0])
    with pytest.raises(ValueError):
        learned_scores("q", passages, positions, features, weights[:-1])


def test_features_are_linear_in_hostile_text():
    text = "A " * 50_000
    passages = [_passage("A" * 1000, text, 0), _passage("B", text, 1)]
    positions = [(0, 0, text), (1, 0, text)]
    started = time.perf_counter()
    features = sentence_features(
        "who " * 1000,
        np.ones(4, dtype=np.float32),
        passages,
        positions,
        np.zeros((2, 4), dtype=np.float32),
        [],
        np.zeros(2),
    )
    hop_features("who " * 1000, passages, positions, np.zeros(2))
    assert features.shape == (2, len(FEATURES)) and time.perf_counter() - started < 5.0
