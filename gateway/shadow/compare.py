"""How far a live answer (from the compressed prompt) agrees with its shadow answer (from the
uncompressed prompt), by several measures, each from 0 (nothing in common) to 1 (the same):

- `exact`: 1 when the two are equal after normalisation (case, accents, punctuation, articles and
  spacing ignored), else 0;
- `token_f1`: the F1 of their normalised words (SQuAD's answer measure);
- `key_spans`: the share of the shadow answer's numbers, dates and names that the live answer
  contains; None when the shadow answer has none;
- `json_fields`: with JSON output, the share of leaf fields (by path) equal in both; None when the
  shadow answer is not JSON.

Answers are bounded by their max_tokens, and every measure here is linear in their length.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from ctxgate.policies.shadow import Comparison

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = re.compile(r"[^\w\s]")
_MONTHS = (
    "january|february|march|april|may|june|july|august|september|october|november|december|"
    "jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec"
)
_DATE = re.compile(
    rf"\b(?:\d{{1,2}}\s+(?:{_MONTHS})\.?(?:\s+\d{{4}})?|(?:{_MONTHS})\.?\s+\d{{1,2}}(?:,?\s+\d{{4}})?"
    rf"|\d{{4}}-\d{{2}}-\d{{2}})\b",
    re.IGNORECASE,
)
_NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*")
# One to four capitalised words in a row (Marie Curie, New York City); a sentence's first word alone
# is not a name.
_NAME = re.compile(r"\b[A-Z][\w'-]*(?:\s+(?:of|de|van|von|the|[A-Z][\w'-]*)){0,3}")
_CONNECTORS = frozenset({"of", "de", "van", "von", "the"})
_MAX_JSON_LEAVES = 10_000


@dataclass(frozen=True)
class Agreement:
    exact: float
    token_f1: float
    key_spans: float | None
    json_fields: float | None

    def headline(self, choice: Comparison) -> tuple[str, float]:
        """The measure a policy chose, as (name, value). `auto`: json_fields where both sides are
        JSON-comparable, else token_f1; a measure with no value for this pair falls back to token_f1."""
        if choice == "auto":
            choice = "json_fields" if self.json_fields is not None else "token_f1"
        value = {
            "exact": self.exact,
            "token_f1": self.token_f1,
            "key_spans": self.key_spans,
            "json_fields": self.json_fields,
        }[choice]
        if value is None:
            return "token_f1", self.token_f1
        return choice, value

    def as_dict(self) -> dict[str, float | None]:
        return {name: None if value is None else round(value, 4) for name, value in asdict(self).items()}


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKD", text.lower())
    text = "".join(ch for ch in text if not unicodedata.combining(ch))
    text = _ARTICLES.sub(" ", _PUNCTUATION.sub(" ", text))
    return " ".join(text.split())


def token_f1(live: str, shadow: str) -> float:
    live_words, shadow_words = normalise(live).split(), normalise(shadow).split()
    if not live_words or not shadow_words:
        return float(live_words == shadow_words)
    common = sum((Counter(live_words) & Counter(shadow_words)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(live_words), common / len(shadow_words)
    return 2 * precision * recall / (precision + recall)


def key_spans(text: str) -> set[str]:
    """The numbers, dates and names in `text`, normalised (thousands separators dropped)."""
    spans = {normalise(match.group(0)) for match in _DATE.finditer(text)}
    spans |= {match.group(0).replace(",", "") for match in _NUMBER.finditer(text)}
    for match in _NAME.finditer(text):
        words = match.group(0).split()
        while words and words[-1] in _CONNECTORS:
            words.pop()
        if len(words) == 1 and _starts_sentence(text, match.start()):
            continue
        spans.add(normalise(" ".join(words)))
    return {span for span in spans if span}


def _starts_sentence(text: str, start: int) -> bool:
    before = start - 1
    while before >= 0 and text[before] in " \t":
        before -= 1
    return before < 0 or text[before] in ".!?:\n"


def key_span_recall(live: str, shadow: str) -> float | None:
    wanted = key_spans(shadow)
    if not wanted:
        return None
    live_text = f" {normalise(live)} {live.replace(',', '')} "
    found = sum(1 for span in wanted if f" {span} " in live_text or _number_in(span, live_text))
    return found / len(wanted)


def _number_in(span: str, text: str) -> bool:
    return span[:1].isdigit() and re.search(rf"(?<![\w.]){re.escape(span)}(?![\w])", text) is not None


def _leaves(value: Any) -> dict[str, Any] | None:
    """Leaf values by dotted path (iteratively: a deep document cannot exhaust the stack); None when
    there are more than the cap."""
    leaves: dict[str, Any] = {}
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict) and node:
            stack.extend((f"{path}.{key}" if path else str(key), child) for key, child in node.items())
        elif isinstance(node, list) and node:
            stack.extend((f"{path}[{index}]", child) for index, child in enumerate(node))
        else:
            leaves[path] = node
        if len(leaves) + len(stack) > _MAX_JSON_LEAVES:
            return None
    return leaves


def _json(text: str) -> Any | None:
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        return json.loads(stripped)
    except (ValueError, RecursionError):
        return None


def json_field_agreement(live: str, shadow: str) -> float | None:
    shadow_value = _json(shadow)
    if shadow_value is None:
        return None
    shadow_leaves = _leaves(shadow_value)
    live_value = _json(live)
    live_leaves = _leaves(live_value) if live_value is not None else None
    if shadow_leaves is None:
        return None
    if live_leaves is None:
        return 0.0
    paths = shadow_leaves.keys() | live_leaves.keys()
    same = sum(
        1
        for path in paths
        if path in shadow_leaves and path in live_leaves and live_leaves[path] == shadow_leaves[path]
    )
    return same / len(paths) if paths else 1.0


def compare(live: str, shadow: str) -> Agreement:
    return Agreement(
        exact=float(normalise(live) == normalise(shadow)),
        token_f1=token_f1(live, shadow),
        key_spans=key_span_recall(live, shadow),
        json_fields=json_field_agreement(live, shadow),
    )
