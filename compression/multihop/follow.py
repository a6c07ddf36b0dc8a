"""The second hop followed after sentence scoring (extraction.second_hop "auto").

Rule: when the trigger (compression.multihop.plan) finds a bridge, its passage's best sentences for
the question completed with the bridge entity are lifted just below the best first-hop sentence,
and, for a question with a bridge form, the linking sentence, the bridge's answer and lead
sentences form one chain the knapsack keeps whole or not at all; passages naming a chained bridge
get their best sentence offered one hop further. Without a trigger nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from compression.multihop.names import mentions
from compression.multihop.plan import FIRST_HOP_SENTENCES, SecondHop, plan_second_hop
from compression.scoring import (
    LEXICAL_WEIGHT,
    SentenceUnit,
    lexical_overlap,
    match_scores,
    store_sentence_scores,
)
from compression.state import Passage
from compression.text import STOPWORDS, content_words, words

# How far below the best first-hop sentence a lifted bridge sentence lands (per rank).
BRIDGE_GAP = 0.05
# Triggered second hop (extraction.second_hop "auto"): how many sentences of each bridge passage
# are lifted, chosen by their match with the question plus the bridge entity.
HOP_SENTENCES = 3
WEAK_GAP = 5 * BRIDGE_GAP  # a weak bridge's sentences: value about 0.12 of the best sentence's
# How much the residual question (its words the linking sentence lacks) adds when the bridge
# passage's answer sentence is chosen.
RESIDUAL_WEIGHT = LEXICAL_WEIGHT
# Third hop: how many other passages naming a followed bridge entity get their best sentence
# offered, and how far below the best first-hop sentence (value about 0.44 of the best's).
THIRD_HOP_PASSAGES = 2
LINK_LEAD_RANK = 1000  # chain rank of a link passage's lead: above every other member's
THIRD_HOP_GAP = 2 * BRIDGE_GAP


def best_units(units: list[SentenceUnit], count: int) -> list[tuple[int, int, str]]:
    """The first hop's best sentences as (passage index, sentence index, text), best first."""
    ranked = sorted(units, key=lambda unit: -unit.score)[:count]
    return [(unit.passage_index, unit.sentence_index, unit.text) for unit in ranked]


def second_hop(
    question: str, units: list[SentenceUnit], passages: list[Passage], embed: Callable[[list[str]], np.ndarray]
) -> SecondHop:
    """extraction.second_hop "auto": after the first hop's scores, decide whether the question needs
    a bridge (compression.multihop) and, only then, follow it. Returns the decision."""
    if len(passages) < 2 or not units:
        return SecondHop(triggered=False)
    strength: dict[int, float] = {}
    for unit in units:
        strength[unit.passage_index] = max(strength.get(unit.passage_index, unit.score), unit.score)
    hop = plan_second_hop(question, passages, best_units(units, FIRST_HOP_SENTENCES), strength=strength)
    if hop.triggered:
        follow_second_hop(question, hop, units, embed)
        store_sentence_scores(units, passages)
    return hop


def follow_second_hop(
    question: str, hop: SecondHop, units: list[SentenceUnit], embed: Callable[[list[str]], np.ndarray]
) -> None:
    """Score each bridge passage's sentences against the question completed with the bridge entity,
    lift its best ones just below the best first-hop sentence, and chain the best one to the
    first-hop sentence that named the entity."""
    top_score = max(unit.score for unit in units)
    position_of = {(unit.passage_index, unit.sentence_index): i for i, unit in enumerate(units)}
    # Every bridge's sentences and hop query in one model call (the loop finds them cached): in
    # the gateway each call waits its turn on the engine thread.
    embed(list(dict.fromkeys(
        [unit.text for unit in units if unit.passage_index in hop.bridges]
        + [f"{question} {entity}" for entity in hop.bridges.values()]
    )))
    for chain_id, (bridge_index, entity) in enumerate(hop.bridges.items()):
        members = [i for i, unit in enumerate(units) if unit.passage_index == bridge_index]
        if not members:
            continue
        texts = [units[i].text for i in members]
        # Bridge sentences may have been left out by the lexical pre-filter: embed them now (a
        # few sentences, and only for questions that take the second hop).
        sentence_vectors = embed(texts)
        hop_query = f"{question} {entity}"
        hop_scores = match_scores(hop_query, texts, sentence_vectors, embed)
        link = position_of.get(hop.links[bridge_index])
        # The answer sentence answers what is left of the question once the entity is known: it
        # matches the question itself, not the entity's name (which every sentence about it has),
        # and above all the words the linking sentence does not already hold ("a suburb of a city
        # with a population of what in 2010": the link says "suburb", the answer "2010 census").
        residual = residual_question(question, units[link].text if link is not None else "", entity)
        answer_scores = match_scores(question, texts, sentence_vectors, embed)
        if residual:
            answer_scores = answer_scores + RESIDUAL_WEIGHT * lexical_overlap(residual, texts)
        answer = members[int(np.argmax(answer_scores))]
        if bridge_index in hop.weak:
            # No bridge form: offer the lead and the best hop sentence a little below the first
            # hop, unchained (mostly one sentence: a single-hop question keeps its budget).
            lead = min(members, key=lambda i: units[i].sentence_index)
            for i in dict.fromkeys((lead, members[int(np.argmax(hop_scores))])):
                units[i].score = max(units[i].score, top_score - WEAK_GAP)
            continue
        lifted = [members[j] for j in np.argsort(-hop_scores, kind="stable")[:HOP_SENTENCES]]
        for rank, i in enumerate(lifted):
            units[i].score = max(units[i].score, top_score - BRIDGE_GAP * (1 + rank))
        # The bridge passage's leading sentence names the entity and says what it is ("Shirley
        # Temple Black ... was an American actress ... and diplomat"): where a bridge question's
        # answer most often is, and what ties the answer sentence to the entity.
        lead = min(members, key=lambda i: units[i].sentence_index)
        for i in (answer, lead):
            units[i].score = max(units[i].score, top_score - BRIDGE_GAP)
        if link is None:
            continue
        # One chain per linking sentence: a sentence naming two bridges takes both whole.
        chain_id = units[link].chain if units[link].chain is not None else chain_id
        # The linking passage's own leading sentence says whom its "he" / "the team" is ("He served
        # as Chamberlain ... of King Kalākaua": "Colonel Charles Hastings Judd ... was ..."): when the
        # link is a later sentence, the lead travels with the chain too (shed first).
        link_lead = min(
            (i for i, unit in enumerate(units) if unit.passage_index == units[link].passage_index),
            key=lambda i: units[i].sentence_index,
        )
        chain = [i for i in dict.fromkeys((link, answer, lead, link_lead)) if units[i].chain in (None, chain_id)]
        chain_score = max(units[i].score for i in chain)
        base = max((u.chain_rank for u in units if u.chain == chain_id and u.chain_rank < LINK_LEAD_RANK), default=0)
        for rank, i in enumerate(chain):
            if units[i].chain is None:
                units[i].chain = chain_id
                # The link passage's lead is shed before any bridge's members.
                units[i].chain_rank = LINK_LEAD_RANK + rank if i == link_lead and i != link else base + rank
            units[i].score = chain_score
    lift_third_hop(question, hop, units, embed, top_score)


def lift_third_hop(
    question: str,
    hop: SecondHop,
    units: list[SentenceUnit],
    embed: Callable[[list[str]], np.ndarray],
    top_score: float,
) -> None:
    """A chain can go one passage further: the question may describe its answer by the bridge
    entity ("the 2009 film starring the actor who played Dexter Morgan": the Dexter passage names
    Michael C. Hall, and the answer's passage names him too). Of the other passages naming a
    followed (chained) bridge entity, the best question-matching sentence of the best
    THIRD_HOP_PASSAGES is offered below the chain, unchained."""
    strong = {index: entity for index, entity in hop.bridges.items() if index not in hop.weak}
    if not strong:
        return
    sources = {link[0] for link in hop.links.values()}
    naming: dict[int, list[int]] = {}
    for position, unit in enumerate(units):
        if unit.passage_index not in hop.bridges and unit.passage_index not in sources:
            naming.setdefault(unit.passage_index, []).append(position)
    passages_naming = [
        members for members in naming.values()
        if any(mentions(units[i].text, entity) for i in members for entity in strong.values())
    ]
    # Every such passage's sentences in one model call (the loop finds them cached): in the
    # gateway each call waits its turn on the engine thread.
    if passages_naming:
        embed(list(dict.fromkeys(units[i].text for members in passages_naming for i in members)))
    candidates: list[tuple[float, int]] = []
    for members in passages_naming:
        texts = [units[i].text for i in members]
        scores = match_scores(question, texts, embed(texts), embed)
        best = int(np.argmax(scores))
        candidates.append((float(scores[best]), members[best]))
    for _, position in sorted(candidates, reverse=True)[:THIRD_HOP_PASSAGES]:
        units[position].score = max(units[position].score, top_score - THIRD_HOP_GAP)


def residual_question(question: str, link_text: str, entity: str) -> str:
    """The question's content words that neither the linking sentence nor the bridge entity holds,
    in question order: what the bridge passage must still answer."""
    covered = content_words(link_text) | content_words(entity)
    return " ".join(dict.fromkeys(word for word in words(question) if word not in STOPWORDS and word not in covered))
