"""What describes a sentence's chance of answering the question, as numbers any question has.

Rule: every feature holds for any question and any passage set (no phrase lists of particular
questions): the sentence's own match with the question (embedding, lexical), its passage's match
and rank, where it sits in its passage, whether it holds the kind of thing the question asks for
(a year for "when", a number for "how many", a name for "who"), the names it adds to the question,
and how it is tied to the best passages (it names one of them, or its passage is named by one: the
bridge of a multi-hop question). ctxgate.compression.learned combines them with weights fitted on the tune
halves of the dev sets (eval/fit_scorer.py); the test halves are never seen by the fit.

Every function here sees client text and runs in time linear in it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ctxgate.compression.multihop.entities import new_entities
from ctxgate.compression.multihop.names import MIN_TITLE_CHARS, mentions, title_core
from ctxgate.compression.rerank import minmax
from ctxgate.compression.state import Passage
from ctxgate.compression.text import content_words

# The feature vector's layout; ctxgate.compression.learned's weights follow this order.
FEATURES = (
    "semantic",  # the sentence's cosine to the question, min-max over the request's sentences
    "cosine",  # the raw cosine (0 where the pre-filter left the sentence unembedded)
    "lexical",  # IDF-weighted share of the question's content words the sentence holds
    "passage",  # its passage's rerank score, min-max over the passages
    "passage_rank",  # 1 / (1 + its passage's rank)
    "lead",  # the passage's first sentence (says what the passage's entity is)
    "answer_type",  # holds the kind of thing the question asks for
    "new_names",  # names the question does not hold (capped share)
    "named_passage",  # its passage's title is named by the question
    "names_top",  # names the title of one of the best passages (other than its own)
    "named_by_top",  # its passage's title is named by one of the best passages
    "length",  # log of its length in characters (longer sentences hold more)
)
# The best passages (by rerank score) that bridge features look at.
TOP_PASSAGES = 3
MAX_NEW_NAMES = 3

_YEAR = re.compile(r"\b(?:1[0-9]{3}|20[0-9]{2})s?\b")
_MONTH = re.compile(
    r"\b(?:january|february|march|april|may|june|july|august|september|october|november|december)\b",
    re.IGNORECASE,
)
_NUMBER = re.compile(
    r"\d|\b(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|hundred|thousand|"
    r"million|billion|dozen)\b",
    re.IGNORECASE,
)
# The question's wh-word (closed classes of English).
_ASKS_DATE = re.compile(r"\bwhen\b|\b(?:what|which) (?:year|date|day|month|century|decade)\b")
_ASKS_NUMBER = re.compile(
    r"\bhow (?:many|much|long|old|far|tall|big|large|often|high)\b|\bwhat (?:percentage|number|age)\b"
)
_ASKS_NAME = re.compile(r"\b(?:who|whom|whose|where|which)\b")


@dataclass(frozen=True)
class AnswerType:
    """What kind of thing the question asks for, from its wh-word (closed classes of English)."""

    date: bool = False
    number: bool = False
    name: bool = False


def answer_type(question: str) -> AnswerType:
    """'when ...' / 'what year ...' -> a date; 'how many/much/long/old ...' -> a number; 'who ...',
    'where ...', 'which ...' -> a name. Anything else: no expectation (the feature stays 0)."""
    lowered = question.lower()
    if _ASKS_DATE.search(lowered):
        return AnswerType(date=True)
    if _ASKS_NUMBER.search(lowered):
        return AnswerType(number=True)
    if _ASKS_NAME.search(lowered):
        return AnswerType(name=True)
    return AnswerType()


def type_match(kind: AnswerType, sentence: str, names: list[str]) -> float:
    """1 when the sentence holds what the question asks for (`names`: the names it adds to the
    question)."""
    if kind.date:
        return 1.0 if _YEAR.search(sentence) or _MONTH.search(sentence) else 0.0
    if kind.number:
        return 1.0 if _NUMBER.search(sentence) else 0.0
    if kind.name:
        return 1.0 if names else 0.0
    return 0.0


def passage_titles(passages: Sequence[Passage]) -> list[str | None]:
    cores = []
    for passage in passages:
        core = title_core(passage.title or "")
        cores.append(core if len(core) >= MIN_TITLE_CHARS and content_words(core) else None)
    return cores


def sentence_features(
    question: str,
    question_vector: np.ndarray,
    passages: Sequence[Passage],
    positions: Sequence[tuple[int, int, str]],
    vectors: np.ndarray,
    embedded: Sequence[int],
    lexical: np.ndarray,
) -> np.ndarray:
    """(len(positions), len(FEATURES)): one row per (passage index, sentence index, text).
    `vectors` holds the sentences' embeddings (rows in `embedded`; the others are zero), `lexical`
    their IDF-weighted overlap with the question."""
    count = len(positions)
    features = np.zeros((count, len(FEATURES)), dtype=np.float64)
    if not count:
        return features
    cosine = np.zeros(count)
    if len(embedded):
        cosine[list(embedded)] = (vectors[list(embedded)] @ question_vector).astype(np.float64)
    semantic = np.zeros(count)
    if len(embedded):
        semantic[list(embedded)] = minmax(cosine[list(embedded)])
    passage_scores = minmax(np.array([p.score for p in passages], dtype=np.float64))
    order = sorted(range(len(passages)), key=lambda i: (-passages[i].score, passages[i].position))
    rank = {index: r for r, index in enumerate(order)}
    top = order[:TOP_PASSAGES]
    cores = passage_titles(passages)
    question_lower = question.lower()
    named = {i for i, core in enumerate(cores) if core and mentions(question_lower, core)}
    named_by_top = np.zeros(len(passages))
    for index, core in enumerate(cores):
        if core is None or index in named:
            continue
        for source in top:
            if source != index and mentions(passages[source].text, core):
                named_by_top[index] = max(named_by_top[index], passage_scores[source])
    top_cores = [(source, cores[source]) for source in top if cores[source] and source not in named]
    kind = answer_type(question)
    for row, (passage_index, sentence_index, text) in enumerate(positions):
        names = new_entities(text, question)
        links = [passage_scores[s] for s, core in top_cores if s != passage_index and mentions(text, core)]
        features[row] = (
            semantic[row],
            cosine[row],
            lexical[row],
            passage_scores[passage_index],
            1.0 / (1.0 + rank[passage_index]),
            1.0 if sentence_index == 0 else 0.0,
            type_match(kind, text, names),
            min(len(names), MAX_NEW_NAMES) / MAX_NEW_NAMES,
            1.0 if passage_index in named else 0.0,
            max(links, default=0.0),
            named_by_top[passage_index],
            math.log1p(len(text)) / 6.0,
        )
    return features


# The second round: what the best sentences of the first round point to (a multi-hop question's
# next passage). ctxgate.compression.learned adds them with their own fitted weights.
HOP_FEATURES = (
    "hop_title",  # its passage's title is named by one of the best first-round sentences
    "hop_name",  # it names a name one of the best first-round sentences adds to the question
    "hop_lead",  # hop_title, for its passage's first sentence (what the entity is)
)
HOP_SOURCES = 3  # the best first-round sentences read for what they point to
# A name more passages hold than this is a topic of the request, not a pointer.
MAX_NAMING_PASSAGES = 2


def hop_features(
    question: str, passages: Sequence[Passage], positions: Sequence[tuple[int, int, str]], first: np.ndarray
) -> np.ndarray:
    """(len(positions), len(HOP_FEATURES)); `first` holds the first round's scores (log-chances).
    A pointer from a first-round sentence weighs its chance relative to the best one's."""
    count = len(positions)
    hop = np.zeros((count, len(HOP_FEATURES)), dtype=np.float64)
    if count < 2:
        return hop
    sources = np.argsort(-first, kind="stable")[:HOP_SOURCES]
    strength = {int(s): float(np.exp(first[s] - first[sources[0]])) for s in sources}
    cores = passage_titles(passages)
    question_lower = question.lower()
    texts = [passage.text for passage in passages]
    # passage index -> strongest first-round sentence (of another passage) naming its title
    titled = np.zeros(len(passages))
    names: list[tuple[str, int, float]] = []  # (name, source passage, strength)
    for source in sources:
        source_passage, _, text = positions[source]
        for index, core in enumerate(cores):
            if (
                core
                and index != source_passage
                and not mentions(question_lower, core)
                and mentions(text, core)
            ):
                titled[index] = max(titled[index], strength[int(source)])
        for name in new_entities(text, question):
            holders = [
                i
                for i, passage_text in enumerate(texts)
                if i != source_passage and mentions(passage_text, name)
            ]
            if 0 < len(holders) <= MAX_NAMING_PASSAGES:
                names.append((name, source_passage, strength[int(source)]))
    for row, (passage_index, sentence_index, text) in enumerate(positions):
        pointed = max(
            (s for name, source, s in names if source != passage_index and mentions(text, name)), default=0.0
        )
        hop[row] = (
            titled[passage_index],
            pointed,
            titled[passage_index] if sentence_index == 0 else 0.0,
        )
    return hop
