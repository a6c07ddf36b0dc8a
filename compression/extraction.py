"""Sentence scoring and budgeted selection of the passages block.

A sentence's relevance fuses its embedding similarity to the question, IDF-weighted lexical overlap
with the question, and its passage's rerank score. The knapsack picks the most relevant set within
the block budget; sentences are then emitted in their original order, passage titles kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from compression.counting import CachedCounter
from compression.knapsack import knapsack
from compression.multihop import FIRST_HOP_SENTENCES, SecondHop, mentions, plan_second_hop, title_core
from compression.rendering import passage_header_cost, render_context
from compression.rerank import minmax
from compression.state import Passage
from compression.text import STOPWORDS, content_words, words
from policies.schema import ExtractionPolicy

# Relevance fusion weights (tuned on nq-multidoc-dev, see the README's eval section).
EMBEDDING_WEIGHT = 0.45
LEXICAL_WEIGHT = 0.35
# Single-hop questions: the sentence lives in a top-ranked passage, so its rank weighs as much as
# the sentence's own match. Multi-hop: the bridge passage ranks low by nature, so it weighs less.
PASSAGE_WEIGHT = 1.0
MULTI_HOP_PASSAGE_WEIGHT = 0.20
# Sharpness of value = exp((score - best) / temperature): the knapsack should prefer one strong
# sentence over several weak ones of the same total cost.
VALUE_TEMPERATURE = 0.12
# Second hop by title mention: how many first-hop passages are read for titles, how many opening
# sentences of a bridge passage are lifted, and how far below the best sentence they land.
BRIDGE_SOURCES = 1
REVERSE_SOURCES = 1
BRIDGE_SENTENCES = 3
BRIDGE_GAP = 0.05
FEEDBACK_WEIGHT = 0.9  # a second-hop match counts a little less than a direct one
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
    # Units of one multi-hop chain (the first-hop sentence naming a bridge entity and the bridge
    # passage's best sentence) share a chain id: the knapsack keeps them together or not at all.
    chain: int | None = None
    # Order inside the chain (0: the linking sentence); a chain too dear for the budget sheds its
    # highest ranks first.
    chain_rank: int = 0


def score_sentences(
    question: str,
    question_vector: np.ndarray,
    passages: list[Passage],
    embed: Callable[[list[str]], np.ndarray],
    policy: ExtractionPolicy,
) -> list[SentenceUnit]:
    expand_query = policy.expand_query
    units: list[SentenceUnit] = []
    for passage_index, passage in enumerate(passages):
        for sentence_index, sentence in enumerate(passage.sentences or []):
            if sentence_index not in passage.removed_sentences:
                units.append(SentenceUnit(passage_index, sentence_index, sentence, 0.0))
    if not units:
        return units
    # Only the pre-filter's candidates are embedded; the others keep a zero vector (semantic 0).
    wanted = [
        position
        for position, unit in enumerate(units)
        if passages[unit.passage_index].embed_sentences is None
        or unit.sentence_index in passages[unit.passage_index].embed_sentences
    ]
    vectors = np.zeros((len(units), len(question_vector)), dtype=np.float32)
    if wanted:
        vectors[wanted] = embed([units[i].text for i in wanted])
    semantic = np.zeros(len(units))
    if wanted:
        semantic[wanted] = minmax((vectors[wanted] @ question_vector).astype(np.float64))
    lexical = lexical_overlap(question, [unit.text for unit in units])
    passage_scores = minmax(np.array([p.score for p in passages], dtype=np.float64))
    passage_weight = MULTI_HOP_PASSAGE_WEIGHT if expand_query else PASSAGE_WEIGHT
    for position, unit in enumerate(units):
        unit.score = float(
            EMBEDDING_WEIGHT * semantic[position]
            + LEXICAL_WEIGHT * lexical[position]
            + passage_weight * passage_scores[unit.passage_index]
        )
    if expand_query and len(units) > 1:
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
    if expand_query and len(passages) > 1:
        boost_bridge_passages(units, passages)
    store_sentence_scores(units, passages)
    return units


def store_sentence_scores(units: list[SentenceUnit], passages: list[Passage]) -> None:
    """Each passage keeps its sentences' scores: the fit stage trims by them."""
    for passage_index, passage in enumerate(passages):
        scores = [0.0] * len(passage.sentences or [])
        for unit in units:
            if unit.passage_index == passage_index:
                scores[unit.sentence_index] = unit.score
        passage.sentence_scores = scores


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


def match_scores(
    query: str, texts: list[str], vectors: np.ndarray, embed: Callable[[list[str]], np.ndarray]
) -> np.ndarray:
    """The first hop's fusion (embedding + lexical) of `texts` against `query`, without the passage
    term: inside one passage only the sentences' own match counts."""
    semantic = vectors @ embed([query])[0]
    return EMBEDDING_WEIGHT * semantic + LEXICAL_WEIGHT * lexical_overlap(query, texts)


def knapsack_items(units: list[SentenceUnit]) -> list[list[int]]:
    """Knapsack items as lists of unit positions: a chain is one item, every other unit its own."""
    items: list[list[int]] = []
    chains: dict[int, list[int]] = {}
    for position, unit in enumerate(units):
        if unit.chain is None:
            items.append([position])
        elif unit.chain in chains:
            chains[unit.chain].append(position)
        else:
            chains[unit.chain] = [position]
            items.append(chains[unit.chain])
    return items


def fit_chains(items: list[list[int]], units: list[SentenceUnit], headers: list[int], budget: int) -> list[list[int]]:
    """A chain dearer than the whole budget (its passages' headers included) could never be taken,
    and taking nothing of it loses the bridge: shed its members of highest chain rank (link, then
    answer, then lead) until it fits; a shed member competes on its own."""
    fitted: list[list[int]] = []
    for item in items:
        item = list(item)
        while len(item) > 1 and (
            sum(units[i].cost for i in item) + sum(headers[p] for p in {units[i].passage_index for i in item}) > budget
        ):
            last = max(item[1:], key=lambda i: units[i].chain_rank)
            item.remove(last)
            fitted.append([last])
        fitted.append(item)
    return fitted


def select_sentences(
    units: list[SentenceUnit], passages: list[Passage], budget: int, counter: CachedCounter, policy: ExtractionPolicy
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
    headers = [passage_header_cost(counter.count, min(i + 1, 99), p, policy.keep_titles) for i, p in enumerate(passages)]

    items = fit_chains(knapsack_items(units), units, headers, budget)
    item_values = [sum(units[i].value for i in item) for item in items]
    item_costs = [sum(units[i].cost for i in item) for item in items]
    reserve = 0
    chosen: list[int] = []
    for _ in range(4):
        chosen_items = knapsack(item_values, item_costs, budget - reserve)
        chosen = sorted(i for item in chosen_items for i in items[item])
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
