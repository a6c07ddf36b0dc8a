"""How a text names a passage: title cores, their owners and undated forms, matched whole-word.

Rule: a title and a sentence (or the question) that spell one name differently ("Tunnels &amp;
Trolls" / "Tunnels and Trolls", "Guns N' Roses" / "Guns N Roses", "Cranberry" / "cranberries") name
the same passage. Every function here sees client text and runs in time linear in it.
"""

from __future__ import annotations

import html
import re

from compression.cache import byte_bounded_cache
from compression.text import content_words

MIN_TITLE_CHARS = 3


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

