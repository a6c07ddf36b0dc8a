"""When a question needs a second hop, and which passages and sentences that hop must keep.

A multi-hop ("bridge") question names one entity and asks about another that only the first
entity's passage names: "What position was held by the woman who portrayed Corliss Archer in the
film Kiss and Tell?" needs the Kiss and Tell passage (it names Shirley Temple) and then the Shirley
Temple passage (it holds the answer). The second passage shares few words with the question, so a
single-hop scorer ranks it low and a tight budget drops it.

The trigger is what the first hop found: a passage the question names by title, or the first
hop's best sentences, name another passage of the request (by title) that the question does not
name, or another passage names the best first-hop passage. That passage is the bridge. The
question's form decides how hard it is followed:

- with a bridge form (the asked-about thing is described through another one: a relative clause
  "the woman who portrayed ...", a reduced relative "a movie starring ...", a role "the director
  of ..."), the chain link -> answer -> bridge lead sentence is kept whole;
- without one, the bridge's best sentences are only offered, below the first hop's: a single-hop
  question whose passage names related articles keeps its budget.

Everything here is plain string work on the request's own titles and sentences: no model call.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

from compression.cache import byte_bounded_cache
from compression.state import Passage
from compression.text import content_words

# "the woman who portrayed", "a chain that operated", "the city in which": a noun phrase followed by
# a relative pronoun describes the asked-about entity through another one.
_RELATIVE_CLAUSE = re.compile(
    r"\b(?:the|a|an|this|that|which|what)\s+(?:[\w'-]+\s+){0,4}?(?:(?:in|of|at|on|for|by|from|with)\s+)?"
    r"(?:who|whom|whose|which|that|where)\s+\w+",
    re.IGNORECASE,
)
# Reduced relatives: "a movie starring X", "a film based on", "an album released by".
_PARTICIPLES = (
    "starring|featuring|based|located|named|called|known|directed|written|produced|founded|born|owned|"
    "created|designed|played|portrayed|released|published|developed|built|hosted|formed|composed|"
    "recorded|performed|coached|managed|led|signed|drafted|adapted|inspired|situated|headquartered"
)
_REDUCED_RELATIVE = re.compile(
    rf"\b(?:the|a|an)\s+(?:[\w'-]+\s+){{0,4}}?(?:{_PARTICIPLES})\s+(?:by|in|on|at|from|as|after|for|with|\w+)",
    re.IGNORECASE,
)
# "this food", "this first round draft pick": the asked-about entity is only described, by what the
# rest of the question says about it (a demonstrative, not "this is" / "this year").
_DEMONSTRATIVE = re.compile(
    r"\bthis\s+(?!(?:is|was|are|were|has|had|will|can|could|would|year|week|month|time|day|morning)\b)[a-z][\w'-]*",
    re.IGNORECASE,
)
# "the director of X", "the father of X": a role held relative to another entity.
_ROLE_OF = re.compile(r"\bthe\s+(?:[\w'-]+\s+){0,2}?(?P<role>[\w'-]+)\s+of\s+\S", re.IGNORECASE)
# Words so general that "the <word> of" names no role ("the name of", "the end of").
_NOT_ROLES = frozenset(
    """name names number meaning origin end start beginning top bottom middle rest part parts size
    length amount type kind form use population capital time date year day season history story
    episode episodes series cast lyrics song words term definition purpose role function""".split()
)

# How many of the first hop's best sentences are read for bridge entities, and how many bridges at
# most are followed (a second hop that follows everything keeps nothing).
FIRST_HOP_SENTENCES = 3
MAX_BRIDGES = 2
CANDIDATE_BRIDGES = 6  # links collected before the best MAX_BRIDGES are chosen
MIN_TITLE_CHARS = 3


def question_form_cues(question: str) -> list[str]:
    """The bridge forms the question has (empty for a plain single-hop question)."""
    cues = []
    body = question.strip()
    if _RELATIVE_CLAUSE.search(body):
        cues.append("relative-clause")
    if _REDUCED_RELATIVE.search(body):
        cues.append("reduced-relative")
    if any(match.group("role").lower() not in _NOT_ROLES for match in _ROLE_OF.finditer(body)):
        cues.append("role-of")
    if _DEMONSTRATIVE.search(body):
        cues.append("demonstrative")
    return cues


@byte_bounded_cache(max_entries=4096, max_bytes=16 * 1024 * 1024)
def normalise(text: str) -> str:
    """Lower-cased, HTML entities decoded, '&' read as 'and', curly quotes straight: the forms a
    title and a sentence (or the question) use for the same name ("Tunnels &amp; Trolls", "Tunnels
    and Trolls")."""
    text = html.unescape(text).lower().replace("\u2019", "'").replace("\u2018", "'")
    if "'" in text:  # "Guns N' Roses" / "Guns N Roses", "James's" / "James'": one form
        text = re.sub(r"(?<=\w)'(?:s\b)?|'(?=\w)|(?<= )'(?= )", "", text)
    return _and_for_ampersands(text) if "&" in text else text


def _and_for_ampersands(text: str) -> str:
    """What substituting " and " for every blank-surrounded '&' pattern (blanks, '&', blanks) gives,
    by splitting: that pattern rescans a run of blanks from each of its characters (quadratic time
    on client text). Each '&' takes the blanks on both sides;
    blanks between two '&' go with the first."""
    parts = text.split("&")
    inner = [part.strip() for part in parts[1:-1]]
    return " and ".join([parts[0].rstrip(), *inner, parts[-1].lstrip()])


def title_core(title: str) -> str:
    """'Boston, Lincolnshire' -> 'boston'; 'Kiss and Tell (1945 film)' -> 'kiss and tell'."""
    return normalise(html.unescape(title).split(" (")[0].split(", ")[0].strip())


def mentions(text: str, phrase: str) -> bool:
    """Whole-word, case-insensitive containment of `phrase` (a title core) in `text`. A phrase may
    end in punctuation ("The Thing of It Is..."), so the edges are 'no word character', not \\b.
    A plural counts: titles are mostly singular nouns ("Cranberry" is named by "cranberries")."""
    # Every pair of passages is tested (a bridge search): the cached forms make it a substring
    # check in the common case that the phrase is not there at all.
    normalised = normalise(text)
    return _mention_stem(phrase) in normalised and _mention_pattern(phrase).search(normalised) is not None


def _mention_stem(phrase: str) -> str:
    """The literal part every match of the phrase contains."""
    return phrase[:-1] if phrase.endswith("y") and len(phrase) > 3 else phrase


@byte_bounded_cache(max_entries=4096, max_bytes=16 * 1024 * 1024)
def _mention_pattern(phrase: str) -> re.Pattern[str]:
    stem = re.escape(_mention_stem(phrase))
    if phrase.endswith("y") and len(phrase) > 3:
        return re.compile(rf"(?<!\w){stem}(?:y|ies)(?!\w)")
    return re.compile(rf"(?<!\w){stem}(?:e?s)?(?!\w)")


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


# A recording's disambiguator names its artist: "Oh My God (Guns N' Roses song)", "Halo (Beyoncé
# song)". The question naming the artist names the passage's subject through it ("a promo Guns N
# Roses performed"). Only recordings: a film's or a series' disambiguator is mostly a year or a
# nationality ("(1945 film)", "(American TV series)").
_WORK_KINDS = "song|single|album|ep|soundtrack|mixtape"
# The disambiguator ends the title: "(", an owner without parentheses, blanks, a kind, ")" and
# blanks. Found from the end of the title by string scanning: the pattern
# `\((?P<owner>[^()]*?)\s+(?:kinds)\)\s*$` tried a lazy owner against every "(" and every blank of a
# run (quadratic time on client text, reached by every title).
_KIND_AT_END = re.compile(rf"(?:{_WORK_KINDS})\Z", re.IGNORECASE)
_LONGEST_KIND = max(len(kind) for kind in _WORK_KINDS.split("|"))


def disambiguator_owner(title: str) -> str | None:
    """The owner a title's recording disambiguator names, as written ('Halo (Beyoncé song)' ->
    'Beyoncé'), or None."""
    close = len(title.rstrip()) - 1
    if close < 0 or title[close] != ")":
        return None
    window = max(0, close - _LONGEST_KIND)
    kind = _KIND_AT_END.search(title, window, close)
    if kind is None:
        return None
    owner_end = kind.start()
    while owner_end > 0 and title[owner_end - 1].isspace():
        owner_end -= 1
    if owner_end == kind.start():
        return None  # the kind must follow a blank
    opening = title.rfind("(", 0, owner_end)
    if opening < 0 or title.find(")", opening, owner_end) >= 0:
        return None
    return title[opening + 1:owner_end]


def title_owner(title: str) -> str:
    """'Oh My God (Guns N' Roses song)' -> "guns n roses"; '' when the disambiguator names no owner
    ('Kiss and Tell (1945 film)': a year is no entity)."""
    found = disambiguator_owner(html.unescape(title))
    if found is None:
        return ""
    owner = normalise(found.strip())
    return owner if len(owner) >= MIN_TITLE_CHARS and any(not w.isdigit() for w in content_words(owner)) else ""


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


# "2013 Sugar Bowl", "1992–93 Charlotte Hornets season": a leading year only dates the entity, and a
# text names it without ("invited to the Sugar Bowl").
_LEADING_YEAR = re.compile(r"^\d{4}(?:[–-]\d{2,4})?\s+")


def undated_cores(cores: list[str | None]) -> list[str | None]:
    """Each usable title core without its leading year, where that form is still a name (two
    content words or more) and no other title of the request shares it."""
    stripped = [_LEADING_YEAR.sub("", core) if core else None for core in cores]
    counts: dict[str, int] = {}
    for core in stripped:
        if core:
            counts[core] = counts.get(core, 0) + 1
    return [
        short if short and core and short != core and counts[short] == 1 and len(content_words(short)) >= 2 else None
        for core, short in zip(cores, stripped, strict=True)
    ]


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
    return bridges, links


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
