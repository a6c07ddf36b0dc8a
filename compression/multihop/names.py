"""How a text names a passage: title cores, matched whole-word.

Rule: a title and a sentence (or the question) that spell one name differently ("Tunnels &amp;
Trolls" / "Tunnels and Trolls", "Guns N' Roses" / "Guns N Roses", "Cranberry" / "cranberries") name
the same passage. Every function here sees client text and runs in time linear in it.
"""

from __future__ import annotations

import html
import re

from ctxgate.compression.store.cache import byte_bounded_cache

MIN_TITLE_CHARS = 3


@byte_bounded_cache(max_entries=4096, budget="names")
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


@byte_bounded_cache(max_entries=4096, budget="mention_patterns")
def _mention_pattern(phrase: str) -> re.Pattern[str]:
    stem = re.escape(_mention_stem(phrase))
    if phrase.endswith("y") and len(phrase) > 3:
        return re.compile(rf"(?<!\w){stem}(?:y|ies)(?!\w)")
    return re.compile(rf"(?<!\w){stem}(?:e?s)?(?!\w)")
