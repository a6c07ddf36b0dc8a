"""Client text is handled in time linear in its length.

Every regular expression that sees request text (documents, titles, messages, index names, headers)
and every public entry point that applies them get inputs built to make a backtracking engine
blow up: long runs of newlines, blanks, "(", "<doc>", "[", digits, repeated marker prefixes,
unterminated tags. Python's `re` holds the GIL for a whole match, so one quadratic match stalls the
event loop and the in-process engine with it. Each case is timed at SMALL and at 10x SMALL
characters (best of 3); linear work grows ~10x, quadratic ~100x. The bound is a ratio, not a
wall-clock limit; the small time is floored so that timer noise on tiny times cannot fail a case.

The rewritten patterns must also mean what the old ones meant (the compressed output must not
change): `test_same_matches_as_before` compares each with the pattern it replaced on random texts
made of the same hostile pieces.
"""

from __future__ import annotations

import gc
import random
import re
import time
import zlib
from collections.abc import Callable

import pytest

from ctxgate.compression import context_lifting, context_passages, context_tags, dedup, rerank, text
from ctxgate.compression.multihop import names
from ctxgate.compression.store.index_names import check_index_name
from ctxgate.gateway import request_id
from ctxgate.gateway.sanitize import _STRUCTURE_LINE, Neutraliser

SMALL = 10_000
LARGE = 10 * SMALL
MAX_RATIO = 30.0  # linear: ~10; quadratic: ~100
FLOOR_S = 0.003

# Hostile inputs, each of about `n` characters.
INPUTS: dict[str, Callable[[int], str]] = {
    "newlines": lambda n: "\n" * n + "x",
    "blank-lines": lambda n: " \n" * (n // 2) + "x",
    "spaces": lambda n: " " * n + "x",
    "tabs": lambda n: "\t" * n + ")",
    "context-spaces": lambda n: "context" + " " * n + "x",
    "context-tabs-newline": lambda n: "\ncontext" + "\t" * n + ")",
    "hashes": lambda n: "#" * n + "x",
    "open-parens": lambda n: "(" * n,
    "paren-spaces": lambda n: "(" + " " * n,
    "paren-spaces-song": lambda n: "(" + " " * n + "x)",
    "doc-tags": lambda n: "<doc>" * (n // 5),
    "doc-tags-unclosed-gt": lambda n: "<doc " * (n // 5),
    "context-tags": lambda n: "<context>" * (n // 9),
    "mixed-closings": lambda n: "<doc>" * (n // 20) + "</passage>" * (n // 20),
    "brackets": lambda n: "[" * n,
    "bracket-digits": lambda n: "[" + "1" * n,
    "header-lines": lambda n: "\n[1" * (n // 3),
    "digits": lambda n: "1" * n,
    "digit-commas": lambda n: "1," * (n // 2),
    "word": lambda n: "a" * n,
    "attribute-words": lambda n: "a " * (n // 2),
    "document-title-spaces": lambda n: "Document [1](Title:" + " " * n + "x",
    "source-spaces": lambda n: "Source" + " " * n + "1",
    "marker-prefixes": lambda n: "Question" * (n // 8),
    "numbered-blocks": lambda n: "[1] x\n" * (n // 6),
    "context-sections": lambda n: ("Context: " + "y" * 80 + "\n\n") * (n // 91),
    "dashes": lambda n: "-" * n + "x",
    "ampersand-blanks": lambda n: " \n" * (n // 2) + "x&",
    "the-words": lambda n: "the a " * (n // 6),
    "quotes": lambda n: "a='" * (n // 3),
}


def _neutraliser() -> Neutraliser:
    return Neutraliser(None)  # no special tokens: the line markers are what is timed here


def _quietly(check: Callable[[str], object]) -> Callable[[str], object]:
    """A validator run for its cost: refusing the hostile name is its expected answer."""

    def run(value: str) -> object:
        try:
            return check(value)
        except ValueError:
            return None

    return run


def _split(value: str) -> list[str]:
    return text.SentenceSplitter().split(value)  # a fresh cache: each run splits


# Every public entry point that reads client text, by name.
ENTRY_POINTS: dict[str, Callable[[str], object]] = {
    "Neutraliser.document": lambda value: _neutraliser().document(value),
    "Neutraliser.text": lambda value: _neutraliser().text(value),
    "context_lifting.find_context(system)": lambda value: context_lifting.find_context(value, system=True),
    "context_lifting.find_context(user)": lambda value: context_lifting.find_context(value, system=False),
    "context_lifting.find_contexts": lambda value: context_lifting.find_contexts(value, system=True),
    "context_passages.split_passages": context_passages.split_passages,
    "multihop.title_core": names.title_core,
    "multihop.normalise": names.normalise.__wrapped__,
    "multihop.mentions": lambda value: (
        names.mentions.__wrapped__(value, "cranberry")
        if hasattr(names.mentions, "__wrapped__")
        else names.mentions(value + " ", "cranberry")
    ),
    "text.SentenceSplitter.split": _split,
    "text.normalize_for_dedup": text.normalize_for_dedup.__wrapped__,
    "text.content_words": text.content_words.__wrapped__,
    "dedup.numbers_in": dedup.numbers_in,
    "rerank.bm25_terms": rerank.bm25_terms,
    "index_names.check_index_name": _quietly(check_index_name),
    "request_id.loggable_path": request_id.loggable_path,
    "request_id.accepted_or_new": lambda value: request_id.accepted_or_new(value.encode()),
}

# Every pattern applied to client text, run the way its module runs it.
PATTERNS: dict[str, tuple[re.Pattern[str], str]] = {
    "sanitize._STRUCTURE_LINE": (_STRUCTURE_LINE, "sub"),
    "context_tags._ATTRIBUTE": (context_tags._ATTRIBUTE, "finditer"),
    "context_lifting._DASHES": (context_lifting._DASHES, "finditer"),
    "context_passages._NUMBERED_STYLES[0]": (context_passages._NUMBERED_STYLES[0], "finditer"),
    "context_passages._NUMBERED_STYLES[1]": (context_passages._NUMBERED_STYLES[1], "finditer"),
    "context_passages._NUMBERED_STYLES[2]": (context_passages._NUMBERED_STYLES[2], "finditer"),
    "context_lifting._SECTION": (context_lifting._SECTION, "finditer"),
    "context_lifting._TERMINATOR": (context_lifting._TERMINATOR, "finditer"),
    "context_passages._METADATA_LINE": (context_passages._METADATA_LINE, "match"),
    "context_passages.PARAGRAPH_BREAK": (context_passages.PARAGRAPH_BREAK, "finditer"),
    "multihop.mention_pattern": (names._mention_pattern("cranberry"), "finditer"),
    "dedup._NUMBER": (dedup._NUMBER, "finditer"),
    "text._WORD_RE": (text._WORD_RE, "finditer"),
    "rerank._BM25_WORD": (rerank._BM25_WORD, "finditer"),
    "request_id._VALID": (request_id._VALID, "match"),
    "request_id._UNSAFE": (request_id._UNSAFE, "finditer"),
}
# The element scanners stand in for `_ELEMENT` / `_CONTAINER` (whose lazy bodies only run between a
# tag and its closing tag).
SCANNERS: dict[str, Callable[[str], object]] = {
    "context_tags.ELEMENTS": lambda value: list(context_tags.ELEMENTS.finditer(value)),
    "context_tags.CONTAINERS": lambda value: context_tags.CONTAINERS.search(value),
}


def _apply(pattern: re.Pattern[str], how: str) -> Callable[[str], object]:
    if how == "sub":
        return lambda value: pattern.sub("", value)
    if how == "match":
        return pattern.match
    return lambda value: list(pattern.finditer(value))


def _best_of_3(work: Callable[[str], object], value: str) -> float:
    """The garbage collector is off while timing (as `timeit` does): its passes over the many match
    objects a long input yields grow faster than the input, whatever the pattern does."""
    best = float("inf")
    gc.disable()
    try:
        for _ in range(3):
            started = time.perf_counter()
            work(value)
            best = min(best, time.perf_counter() - started)
    finally:
        gc.enable()
    return best


def _assert_linear(work: Callable[[str], object], build: Callable[[int], str]) -> None:
    small, large = build(SMALL), build(LARGE)
    work(small)  # warm-up: lazy imports, compiled patterns, tables
    small_s = max(_best_of_3(work, small), FLOOR_S)
    large_s = _best_of_3(work, large)
    ratio = large_s / small_s
    assert ratio < MAX_RATIO, (
        f"{len(large)} chars took {large_s:.3f}s, {len(small)} chars {small_s:.4f}s: x{ratio:.0f}"
    )


CASES = (
    [
        pytest.param(work, build, id=f"{name}-{shape}")
        for name, work in ENTRY_POINTS.items()
        for shape, build in INPUTS.items()
    ]
    + [
        pytest.param(_apply(*spec), build, id=f"{name}-{shape}")
        for name, spec in PATTERNS.items()
        for shape, build in INPUTS.items()
    ]
    + [
        pytest.param(work, build, id=f"{name}-{shape}")
        for name, work in SCANNERS.items()
        for shape, build in INPUTS.items()
    ]
)


@pytest.mark.parametrize(("work", "build"), CASES)
def test_work_grows_linearly(work: Callable[[str], object], build: Callable[[int], str]) -> None:
    _assert_linear(work, build)


def test_tokenizer_grows_linearly(tokenizer) -> None:
    """The model's tokenizer counts every request's text (the budget): no input shape may make it
    quadratic either."""
    for shape in ("newlines", "spaces", "word", "digits", "open-parens", "doc-tags", "blank-lines"):
        _assert_linear(tokenizer.encode, INPUTS[shape])


# -- the rewrites mean what the old patterns meant ----------------------------------------------------
_OLD_STRUCTURE_LINE = re.compile(
    r"^(\s*)("
    + "|".join(re.escape(m) for m in ("Documents:", "Question:", "Summary of the earlier conversation:"))
    + r"|\[\d+\])",
    re.IGNORECASE | re.MULTILINE,
)
_OLD = {
    "_ELEMENT": re.compile(
        r"<(?P<tag>document|doc|passage|source|search_result|result)\b(?P<attrs>[^>]*)>(?P<body>.*?)</(?P=tag)\s*>",
        re.IGNORECASE | re.DOTALL,
    ),
    "_CONTAINER": re.compile(
        r"<(?P<tag>context|contexts|documents|docs|sources|search_results|retrieved_context|knowledge)\b[^>]*>"
        r"(?P<body>.*?)</(?P=tag)\s*>",
        re.IGNORECASE | re.DOTALL,
    ),
    "_ATTRIBUTE": re.compile(r"""(\w+)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]+))"""),
    "_NUMBERED_STYLES[0]": re.compile(
        r"^[ \t]*Document[ \t]*\[(?P<n>\d+)\](?:[ \t]*\(Title:[ \t]*(?P<title>[^\n]*?)\))?[ \t]*(?P<rest>[^\n]*)",
        re.MULTILINE | re.IGNORECASE,
    ),
    "_NUMBERED_STYLES[1]": re.compile(
        r"^[ \t]*(?:Document|Source|Passage|Doc|Context|Chunk|Excerpt)[ \t]*#?[ \t]*(?P<n>\d+)[ \t]*[:.)\-][ \t]*"
        r"(?P<rest>[^\n]*)",
        re.MULTILINE | re.IGNORECASE,
    ),
    "_NUMBERED_STYLES[2]": re.compile(r"^[ \t]*\[(?P<n>\d+)\][ \t]*(?P<rest>[^\n]*)", re.MULTILINE),
    "_SECTION": re.compile(
        r"^[ \t]*(?:#+[ \t]*)?(?:context|contexts|context information|retrieved context|relevant context|documents|"
        r"retrieved documents|sources|references|search results|background|knowledge)[ \t]*:?[ \t]*$"
        r"|^[ \t]*(?:context|contexts|retrieved context|documents|sources)[ \t]*:[ \t]*(?=\S)",
        re.MULTILINE | re.IGNORECASE,
    ),
    "_TERMINATOR": re.compile(
        r"^[ \t]*(?:#+[ \t]*)?(?:(?:question|query|user question|q|answer|instructions?|task|helpful answer)[ \t]*:"
        r"|given the context\b)",
        re.MULTILINE | re.IGNORECASE,
    ),
}

# Pieces the random texts are made of: every marker, tag and separator the patterns look for, in
# several cases (with the characters Unicode case folding matches: İ, K, ſ), and the blanks between.
PIECES = [
    "\n",
    "\n\n",
    " ",
    "\t",
    " \n",
    "\r",
    "\u2028",
    "\x85",
    "#",
    "##",
    ":",
    ".",
    ")",
    "(",
    "-",
    "---",
    "[",
    "]",
    "[1]",
    "[12]",
    "1",
    "42",
    "=",
    '"',
    "'",
    ">",
    "<",
    "</",
    "&",
    "x",
    "word",
    "a b",
    "?",
    "Documents:",
    "Question:",
    "Summary of the earlier conversation:",
    "question",
    "Query",
    "Answer",
    "given the context",
    "Context",
    "context",
    "CONTEXT",
    "contexts",
    "context information",
    "Sources",
    "documents",
    "Document",
    "Doc",
    "Source",
    "Passage",
    "Title:",
    "(Title: ",
    "Document [1]",
    "Source 2:",
    "<doc>",
    "</doc>",
    "<DOC id=1>",
    "</Doc >",
    "<document title='t'>",
    "</document>",
    "<ſource>",
    "</source>",
    "</ſource>",
    '<passage id="3">',
    "</passage>",
    "<context>",
    "</context>",
    "<knowledge>",
    "</\u212anowledge>",
    "<retr\u0130eved_context>",
    "</retrieved_context>",
    "<docs>",
    "</docs>",
    "<result>",
    "</result>",
    "<search_result x=y>",
    "</search_result>",
    " song",
    " Song)",
    " album)",
    " ep)",
    "mixtape",
    "ſingle",
    "Guns N' Roses",
    "(1945 film)",
]


def _random_texts(count: int, pieces: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, pieces))) for _ in range(count)]


def _spans(matches) -> list[tuple]:
    return [(m.span(), m.groups(), sorted(m.groupdict().items())) for m in matches]


_CURRENT = {
    "_ELEMENT": context_tags.ELEMENTS,
    "_CONTAINER": context_tags.CONTAINERS,
    "_ATTRIBUTE": context_tags._ATTRIBUTE,
    "_NUMBERED_STYLES[0]": context_passages._NUMBERED_STYLES[0],
    "_NUMBERED_STYLES[1]": context_passages._NUMBERED_STYLES[1],
    "_NUMBERED_STYLES[2]": context_passages._NUMBERED_STYLES[2],
    "_SECTION": context_lifting._SECTION,
    "_TERMINATOR": context_lifting._TERMINATOR,
}


@pytest.mark.parametrize("name", sorted(_OLD))
def test_same_matches_as_before(name: str) -> None:
    for value in _random_texts(3000, 30, seed=zlib.crc32(name.encode())):
        assert _spans(_CURRENT[name].finditer(value)) == _spans(_OLD[name].finditer(value)), value


def test_same_attributes_as_before() -> None:
    rng = random.Random(7)
    pieces = ["a", "id", "title", "=", " ", "\t", '"', "'", "x y", "-", "é", "1", "ab_c"]
    for _ in range(5000):
        value = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 20)))
        assert _spans(context_tags._ATTRIBUTE.finditer(value)) == _spans(
            _OLD["_ATTRIBUTE"].finditer(value)
        ), value


def test_same_structure_lines_as_before() -> None:
    def quote(match: re.Match[str]) -> str:
        return f"{match.group(1)}> {match.group(2)}"

    for value in _random_texts(5000, 30, seed=11):
        assert _STRUCTURE_LINE.sub(quote, value) == _OLD_STRUCTURE_LINE.sub(quote, value), value


def test_same_ampersands_as_before() -> None:
    rng = random.Random(17)
    pieces = ["&", " ", "\n", "\t", "\u00a0", "a", "b c", "&&", " & "]
    for _ in range(5000):
        value = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 15))) + "&"
        assert names._and_for_ampersands(value) == re.sub(r"\s*&\s*", " and ", value), value


def test_gap_after_a_header_as_before() -> None:
    block = "[1]  \t\n body one\n\n[2]\u2028 body two\n[3]"
    headers = context_passages.numbered_headers(block)
    for header in headers:
        after = block[header.start("rest") :]
        expected = after[: len(after) - len(after.lstrip())]
        assert context_passages._gap(block, header.start("rest"), "body") == expected
