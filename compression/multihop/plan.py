"""The second-hop trigger: whether a question needs a bridge passage, and which ones.

Rule: a hop is planned only from what the first hop found (a passage the question names by title,
or the best first-hop sentences, naming another passage of the request; or another passage naming
a best first-hop passage), and at most `max_bridges` are followed; the question's form decides
whether a bridge is followed whole (a chain) or only offered (`SecondHop.weak`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compression.multihop.entities import new_entities, passages_naming
from compression.multihop.forms import question_form_cues
from compression.multihop.names import MIN_TITLE_CHARS, mentions, title_core, title_owner, undated_cores
from compression.state import Passage
from compression.text import content_words

# How many of the first hop's best sentences are read for bridge entities, and how many bridges at
# most are followed (a second hop that follows everything keeps nothing).
FIRST_HOP_SENTENCES = 3
MAX_BRIDGES = 2
CANDIDATE_BRIDGES = 6  # links collected before the best MAX_BRIDGES are chosen
# A name more passages than this name is a topic of the request (or an ambiguous name), not a link.
MAX_NAMING_PASSAGES = 1


@dataclass
class SecondHop:
    """The outcome of the trigger: why (or why not), and the bridge passages with their entity."""

    triggered: bool
    cues: list[str] = field(default_factory=list)
    # passage index -> the bridge entity (its title core) the first hop named
    bridges: dict[int, str] = field(default_factory=dict)
    # bridge passage index -> the first-hop sentence that names it, as (passage, sentence) indices
    links: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Bridges found without a bridge form in the question and not through a passage it names:
    # followed cheaply (their best sentences offered, no chain), since for a single-hop question
    # such a link is mostly incidental.
    weak: set[int] = field(default_factory=set)

    def details(self) -> dict[str, object]:
        return {"second_hop": self.triggered, "cues": self.cues, "bridges": sorted(set(self.bridges.values()))}



def named_passages(question: str, passages: list[Passage]) -> list[int]:
    """Passages whose title the question names: the entities the question starts from. Their text
    is a first hop of its own, however the reranker placed them ("the city in which Kirton End is
    located": the Kirton End passage names the city). A title's owner counts ("Guns N Roses" names
    'Oh My God (Guns N' Roses song)')."""
    question_lower = question.lower()
    named = []
    for index, passage in enumerate(passages):
        core = title_core(passage.title or "")
        owner = title_owner(passage.title or "")
        if (len(core) >= MIN_TITLE_CHARS and len(content_words(core)) and mentions(question_lower, core)) or (
            owner and mentions(question_lower, owner)
        ):
            named.append(index)
    return named


def entity_sentences(passages: list[Passage], indices: list[int]) -> list[tuple[int, int, str]]:
    """(passage, sentence, text) of the live sentences of the passages at `indices`."""
    found: list[tuple[int, int, str]] = []
    for index in indices:
        passage = passages[index]
        sentences = passage.sentences or [passage.text]
        found.extend(
            (index, si, sentence) for si, sentence in enumerate(sentences) if si not in passage.removed_sentences
        )
    return found


def linked_passages(
    question: str, passages: list[Passage], first_hop: list[tuple[int, int, str]], limit: int = MAX_BRIDGES
) -> tuple[dict[int, str], dict[int, tuple[int, int]]]:
    """Passages (by index) whose title the first hop's sentences name and the question does not.

    `first_hop` holds (passage index, sentence index, text) of the best first-hop sentences, best
    first; a bridge named by a better sentence comes first."""
    question_lower = question.lower()
    question_words = content_words(question)
    cores = []
    for passage in passages:
        core = title_core(passage.title or "")
        usable = (
            len(core) >= MIN_TITLE_CHARS
            and not mentions(question_lower, core)
            # every word of the title already in the question: no new entity
            and not content_words(core) <= question_words
        )
        cores.append(core if usable else None)
    undated = [
        short if short and not mentions(question_lower, short) else None for short in undated_cores(cores)
    ]
    bridges: dict[int, str] = {}
    links: dict[int, tuple[int, int]] = {}
    for passage_index, sentence_index, text in first_hop:
        text_lower = text.lower()
        for index, core in enumerate(cores):
            if core is None or index == passage_index or index in bridges:  # a passage naming itself bridges nothing
                continue
            if mentions(text_lower, core) or (undated[index] is not None and mentions(text_lower, undated[index])):
                bridges[index] = core
                links[index] = (passage_index, sentence_index)
            if len(bridges) >= limit:
                return bridges, links
    if bridges:
        return bridges, links
    # No title named: the bridge entity may be no passage's title; its name still points there.
    for passage_index, sentence_index, text in first_hop:
        for index, entity in entity_links(question, passages, text, skip={passage_index, *bridges}).items():
            bridges[index] = entity
            links[index] = (passage_index, sentence_index)
            if len(bridges) >= limit:
                return bridges, links
    return bridges, links


def title_forms(title: str) -> set[str]:
    """The forms a title is named by here: its core and its core without a leading year."""
    core = title_core(title)
    return {core, *(short for short in undated_cores([core]) if short)}


def entity_links(question: str, passages: list[Passage], text: str, skip: set[int]) -> dict[int, str]:
    """Passages (not in `skip`) whose text names a name `text` adds to the question, whatever their
    titles: the bridge entity is often no passage's title (compression.multihop.entities). A name
    many passages share is a topic, not a link, and is passed over."""
    texts = [passage.text for passage in passages]
    found: dict[int, str] = {}
    for entity in new_entities(text, question):
        naming = passages_naming(entity, texts, skip)
        if 0 < len(naming) <= MAX_NAMING_PASSAGES:
            for index in naming:
                found.setdefault(index, entity)
    return found


def reverse_links(
    question: str, passages: list[Passage], first_hop: list[tuple[int, int, str]], limit: int
) -> tuple[dict[int, str], dict[int, tuple[int, int]]]:
    """Passages that name a passage of the best first-hop sentences, when the question does not
    name it: the first hop found an entity the question only describes ("the ceremonial meeting
    place of the Accession Council": St James's Palace), and the asked-about thing is described
    by its relation to that entity ("Mark Masons' Hall ... opposite St James's Palace")."""
    question_words = content_words(question)
    bridges: dict[int, str] = {}
    links: dict[int, tuple[int, int]] = {}
    seen: set[int] = set()
    for source, sentence_index, _ in first_hop:
        if source in seen:
            continue
        seen.add(source)
        core = title_core(passages[source].title or "")
        if len(core) < MIN_TITLE_CHARS or mentions(question, core) or content_words(core) <= question_words:
            continue
        for index, passage in enumerate(passages):
            own = title_core(passage.title or "")
            if index == source or index in bridges or (own and mentions(question, own)):
                continue  # the question names this passage: it is where the question starts, no bridge
            if mentions(passage.text, core):
                bridges[index] = own or core
                links[index] = (source, sentence_index)
                if len(bridges) >= limit:
                    return bridges, links
    return bridges, links


def plan_second_hop(
    question: str,
    passages: list[Passage],
    first_hop: list[tuple[int, int, str]],
    max_bridges: int = MAX_BRIDGES,
    strength: dict[int, float] | None = None,
) -> SecondHop:
    """The trigger: a bridge entity the first hop found.

    - A passage the question names by title (the entity it starts from) that names another
      passage: followed whatever the question's form, since bridge questions come in too many
      forms for a pattern list ("the Argentine PGA Championship record holder", "this food"), and
      a question naming an entity whose passage names another is rare for a single-hop question.
    - The best first-hop sentences naming another passage, or another passage naming a best
      first-hop passage: followed whole (chained) when the question has a bridge form (cues);
      without one, only weakly (`SecondHop.weak`): such links are often incidental for a
      single-hop question (its answer's passage names related articles), and a chain would spend
      its budget on other passages.

    Of the candidates, the `max_bridges` whose passages match the question best are followed: by
    `strength` (passage index -> its best sentence's first-hop score) where the sentences are
    scored, else by the passage's rerank score; links from a passage the question names first."""
    cues = question_form_cues(question)
    named = named_passages(question, passages)
    sources = entity_sentences(passages, named) + [item for item in first_hop if item[0] not in named]
    bridges, links = linked_passages(question, passages, sources, limit=CANDIDATE_BRIDGES)
    back, back_links = reverse_links(question, passages, first_hop, limit=CANDIDATE_BRIDGES)
    for index in back:
        if index not in bridges:
            bridges[index], links[index] = back[index], back_links[index]
    weak = set() if cues else set(bridges)
    # A name-only link (no title named) without a bridge form is mostly incidental for a
    # single-hop question: dropped, so its budget stays with the first hop.
    if not cues:
        titled = {index for index in bridges if bridges[index] in title_forms(passages[index].title or "")}
        bridges = {index: bridges[index] for index in bridges if index in titled}
    def match(index: int) -> float:
        return strength.get(index, 0.0) if strength is not None else passages[index].score

    # A link from a passage the question names comes first: the question starts there, whereas a
    # best first-hop passage may be a near miss (a hub article that six season articles name).
    best = sorted(bridges, key=lambda index: (links[index][0] not in named, -match(index)))[:max_bridges]
    return SecondHop(
        triggered=bool(best),
        cues=cues,
        bridges={index: bridges[index] for index in best},
        links={index: links[index] for index in best},
        weak={index for index in best if index in weak},
    )


def first_hop_passage_sentences(passages: list[Passage], ranked: list[int], count: int) -> list[tuple[int, int, str]]:
    """Before sentence scores exist (at rerank): the live sentences of the `count` best passages,
    standing in for the first hop's best sentences."""
    found: list[tuple[int, int, str]] = []
    for index in ranked[:count]:
        passage = passages[index]
        sentences = passage.sentences or [passage.text]
        found.extend(
            (index, si, sentence) for si, sentence in enumerate(sentences) if si not in passage.removed_sentences
        )
    return found
