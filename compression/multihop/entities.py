"""The entities a sentence names that the question does not.

A bridge entity is often no passage's title: "the person Mach's principle was named after" is
Ernst Mach, whom the Mach's principle passage names and whose employer's passage ("Vinko Dvořák
... assistant to Ernst Mach at Charles University") names him again. What holds for any question:
the names a first-hop sentence adds to the question (capitalised word runs it does not hold) point
to the passages that name them as well, and those are where the next hop continues
(ctxgate.compression.sentence_features' link and pointer features).

Every function here sees client text and runs in time linear in it (one regular-expression scan
without nested repetition, then set and substring work).
"""

from __future__ import annotations

import re

from ctxgate.compression.multihop.names import mentions, normalise
from ctxgate.compression.text import STOPWORDS, content_words

# A name: capitalised words (or numbers inside one: "Louis XIV", "Apollo 11"), joined by blanks and
# the lower-case particles names carry ("Charles University", "Mark Twain", "Alice de Lusignan",
# "House of Commons"). The particles are a closed list, matched as whole words.
_PARTICLES = "of|de|la|le|du|von|van|der|den|di|da|del|bin|al"
_NAME = re.compile(rf"[A-Z][\w'’-]*(?:[ \t]+(?:(?:{_PARTICLES})[ \t]+)?(?:[A-Z][\w'’-]*|\d+\b))*")
# A name of one word that is one of these says nothing (sentence openers, pronouns, months).
_NOT_NAMES = frozenset(
    """he she it they we you i his her its their our this that these those there here when where what
    which who whom whose why how in on at by for from with as after before during since until
    while although though however also but and or if then thus after later january february march
    april may june july august september october november december monday tuesday wednesday
    thursday friday saturday sunday""".split()
)
MIN_ENTITY_CHARS = 4
# Entities read per sentence, at most (a list sentence names dozens; the first ones matter).
MAX_ENTITIES = 8


def entities(text: str) -> list[str]:
    """The names `text` holds, normalised (ctxgate.compression.multihop.names.normalise), in text order,
    without duplicates: 'He was an assistant to Ernst Mach at Charles University' ->
    ['ernst mach', 'charles university']."""
    found: dict[str, None] = {}
    for match in _NAME.finditer(text):
        name = normalise(match.group(0).strip(" .'’-"))
        # A leading "the"/"The" belongs to the sentence more often than to the name.
        if name.startswith("the "):
            name = name[4:]
        tokens = name.split()
        if not tokens or (len(tokens) == 1 and tokens[0] in _NOT_NAMES):
            continue
        if len(name) < MIN_ENTITY_CHARS or not any(t not in STOPWORDS and not t.isdigit() for t in tokens):
            continue
        found[name] = None
        if len(found) >= MAX_ENTITIES:
            break
    return list(found)


def new_entities(text: str, question: str) -> list[str]:
    """The names of `text` the question does not already name: what a first-hop sentence adds."""
    question_lower = question.lower()
    question_words = content_words(question)
    return [
        name
        for name in entities(text)
        if not mentions(question_lower, name) and not content_words(name) <= question_words
    ]
