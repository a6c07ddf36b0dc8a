"""XML-ish elements in client text (`<document>`, `<doc id=..>`, `<passage>`, ... and the
`<context>`/`<documents>`/`<sources>` containers), found in time linear in the text, and an element
turned into a passage that keeps its tags as its frame (compression/context_lifting.py)."""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterator

from ctxgate.compression.context_passages import FoundPassage

_ELEMENT_TAGS = "document|doc|passage|source|search_result|result"
_CONTAINER_TAGS = "context|contexts|documents|docs|sources|search_results|retrieved_context|knowledge"
# What an element is; found through `_Elements` (a lazy `.*?` body with no closing tag scans to the end
# of the text from every opening tag, quadratic time on client text), and matched with these only
# between an opening tag and the closing tag `_Elements` found for it.
_ELEMENT = re.compile(
    rf"<(?P<tag>{_ELEMENT_TAGS})\b(?P<attrs>[^>]*)>(?P<body>.*?)</(?P=tag)\s*>",
    re.IGNORECASE | re.DOTALL,
)
_CONTAINER = re.compile(
    rf"<(?P<tag>{_CONTAINER_TAGS})\b[^>]*>(?P<body>.*?)</(?P=tag)\s*>",
    re.IGNORECASE | re.DOTALL,
)
# Possessive and anchored at a word's start: an attribute name cannot start inside a word (the
# word's own start would have matched first), and none of the value forms starts with whitespace.
_ATTRIBUTE = re.compile(r"""(?<!\w)(\w++)\s*+=\s*+(?:"([^"]*)"|'([^']*)'|([^\s>]+))""")


def _fold(tag: str) -> str:
    """A tag name as `(?P=tag)` compares it under IGNORECASE: character by character, by simple
    lower case (only U+0130's full lower case, "i" + a combining dot, is longer than one character)."""
    return tag.replace("\u0130", "i").lower()


class _Elements:
    """The matches `pattern.finditer` returns (an opening tag, a lazy body, the same tag closing),
    found in time linear in the text: every closing tag is listed once, so an opening tag with no
    closing tag after it costs a lookup instead of a scan to the end of the text."""

    def __init__(self, tags: str, pattern: re.Pattern[str]):
        self._open = re.compile(rf"<({tags})\b", re.IGNORECASE)
        self._close = re.compile(rf"</({tags})\s*+>", re.IGNORECASE)
        self._pattern = pattern

    def finditer(self, text: str) -> Iterator[re.Match[str]]:
        closings: dict[str, tuple[list[int], list[int]]] | None = None
        position = 0
        tag_end = -1  # the first ">" at or after the last opening tag's name
        while (opening := self._open.search(text, position)) is not None:
            if tag_end < opening.end():
                tag_end = text.find(">", opening.end())
                if tag_end < 0:
                    return  # no opening tag can end
            if closings is None:
                closings = self._closings(text)
            starts, ends = closings.get(_fold(opening.group(1)), ((), ()))
            index = bisect_left(starts, tag_end + 1)
            if index == len(starts):
                position = opening.start() + 1
                continue
            # The lazy body stops at the first closing tag of the same name: the pattern, matched
            # up to there, is the whole match (and reads only the element itself).
            match = self._pattern.match(text, opening.start(), ends[index])
            if match is None:
                position = opening.start() + 1
                continue
            yield match
            position = match.end()

    def search(self, text: str) -> re.Match[str] | None:
        return next(self.finditer(text), None)

    def _closings(self, text: str) -> dict[str, tuple[list[int], list[int]]]:
        found: dict[str, tuple[list[int], list[int]]] = {}
        for closing in self._close.finditer(text):
            starts, ends = found.setdefault(_fold(closing.group(1)), ([], []))
            starts.append(closing.start())
            ends.append(closing.end())
        return found


ELEMENTS = _Elements(_ELEMENT_TAGS, _ELEMENT)
CONTAINERS = _Elements(_CONTAINER_TAGS, _CONTAINER)


def element_passage(match: re.Match[str]) -> FoundPassage:
    body = match.group("body")
    attrs = {
        m.group(1).lower(): m.group(2) or m.group(3) or m.group(4) or ""
        for m in _ATTRIBUTE.finditer(match.group("attrs"))
    }
    stripped = body.strip()
    lead = body[: len(body) - len(body.lstrip())]
    trail = body[len(body.rstrip()) :]
    open_tag = match.group(0)[: match.start("body") - match.start()]
    close_tag = match.group(0)[match.end("body") - match.start() :]
    return FoundPassage(
        stripped,
        (open_tag + lead, trail + close_tag),
        title=attrs.get("title"),
        id=attrs.get("id") or attrs.get("index"),
    )
