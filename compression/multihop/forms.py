"""The question's form: whether it describes the asked-about thing through another entity.

A bridge form (a relative clause "the woman who portrayed ...", a reduced relative "a movie
starring ...", a role "the director of ...", a demonstrative "this food") is what makes a found
bridge worth following whole; without one a bridge is only offered (compression.multihop.plan).
Every pattern here sees client text: each runs in time linear in it (tests/security).
"""

from __future__ import annotations

import re

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

