"""Encoding any client text through tiktoken without reaching its regular-expression limits.

tiktoken splits text with fancy-regex before merging. The split patterns of GPT-2 (our byte-level
models through `ctxgate.backend.model.fast_bpe`), cl100k and o200k hold `\\s+(?!\\S)`, which backtracks once per
character of a whitespace run; on a run of about a million characters the engine gives up with
`ValueError: ... Max stack size exceeded for backtracking`: a 1M-newline prompt was a 500.

Every tiktoken encode therefore goes through `encode_in_pieces`: the text is cut only inside
whitespace runs longer than `MAX_WHITESPACE_RUN` (a sixteenth of where the limit was measured),
every `MAX_WHITESPACE_RUN` characters of the run, and the pieces are encoded one by one. Text
without such a run (every real prompt) is encoded whole, so its ids are exactly tiktoken's. A longer
run has no exact encoding to keep (it is the input tiktoken refuses); cut at a power of two, a
run of one repeated character still gets the ids of the whole run for vocabularies whose longest
run token divides it (SmolLM2's newlines: identical counts at 1M).
"""

from __future__ import annotations

import re
from collections.abc import Callable

# Unicode White_Space: what `\s` matches in the Rust regex engines tiktoken uses (Python's
# str.isspace also counts U+001C..U+001F, which those engines do not).
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
MAX_WHITESPACE_RUN = 1 << 16
# A run's start (lookbehind: no whitespace before it), only where the run is over the cap: each run is
# scanned once from its start, so finding them is linear in the text.
_LONG_RUN_START = re.compile(f"(?<![{_WHITESPACE}])[{_WHITESPACE}]{{{MAX_WHITESPACE_RUN + 1}}}")
_RUN = re.compile(f"[{_WHITESPACE}]*")


class TextNotTokenizable(ValueError):
    """The tokenizer library refused a text. Its own message (regex internals, sizes) stays in the
    log: callers answer with a message naming the request field instead."""

    def __init__(self) -> None:
        super().__init__("the text could not be tokenized")


def pieces(text: str) -> list[str]:
    """`text` cut inside whitespace runs longer than `MAX_WHITESPACE_RUN` (and nowhere else), so no
    piece holds a longer run; `[text]` when it has none."""
    if len(text) <= MAX_WHITESPACE_RUN:
        return [text]
    cuts: list[int] = []
    position = 0
    while (match := _LONG_RUN_START.search(text, position)) is not None:
        start = match.start()
        end = _RUN.match(text, start).end()
        cuts.extend(range(start + MAX_WHITESPACE_RUN, end, MAX_WHITESPACE_RUN))
        position = end
    if not cuts:
        return [text]
    bounds = [0, *cuts, len(text)]
    return [text[left:right] for left, right in zip(bounds, bounds[1:], strict=False)]


def encode_in_pieces(encode: Callable[[str], list[int]], text: str) -> list[int]:
    """`encode(text)`, piece by piece where the text has an over-long whitespace run; a refusal by the
    library is `TextNotTokenizable`."""
    try:
        parts = pieces(text)
        if len(parts) == 1:
            return encode(text)
        ids: list[int] = []
        for part in parts:
            ids.extend(encode(part))
        return ids
    except ValueError as exc:
        raise TextNotTokenizable() from exc


def encode_batch_in_pieces(
    encode_batch: Callable[[list[str]], list[list[int]]], texts: list[str]
) -> list[list[int]]:
    """`encode_batch(texts)` with each text cut as `pieces` does, the pieces' ids joined back per text."""
    split = [pieces(text) for text in texts]
    if all(len(parts) == 1 for parts in split):
        flat, owners = texts, None
    else:
        flat = [part for parts in split for part in parts]
        owners = [index for index, parts in enumerate(split) for _ in parts]
    try:
        encoded = encode_batch(flat)
    except ValueError as exc:
        raise TextNotTokenizable() from exc
    if owners is None:
        return encoded
    joined: list[list[int]] = [[] for _ in texts]
    for owner, ids in zip(owners, encoded, strict=True):
        joined[owner].extend(ids)
    return joined
