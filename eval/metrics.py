"""Answer scoring and evidence retention (summary statistics: eval/stats.py).

Answer normalization follows the usual open-domain QA convention (SQuAD): lower-case, drop
punctuation and the articles a/an/the, collapse whitespace. Accuracy is "a gold answer is contained
in the normalized reply" — the metric the lost-in-the-middle and LongLLMLingua papers report.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation + "‘’“”–—")


def normalize_answer(text: str) -> str:
    lowered = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", lowered).split())


def _contains_phrase(haystack: str, needle: str) -> bool:
    """Whole-word containment on normalized text ("no" must not match inside "nobody")."""
    if not needle:
        return False
    return f" {needle} " in f" {haystack} "


def answer_in_text(text: str, answers: Sequence[str]) -> bool:
    normalized = normalize_answer(text)
    return any(_contains_phrase(normalized, normalize_answer(answer)) for answer in answers)


def exact_match(prediction: str, answers: Sequence[str]) -> bool:
    normalized = normalize_answer(prediction)
    return any(normalized == normalize_answer(answer) for answer in answers)


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """Best bag-of-words F1 between the prediction and any gold answer."""
    prediction_tokens = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        answer_tokens = normalize_answer(answer).split()
        if not prediction_tokens or not answer_tokens:
            best = max(best, float(prediction_tokens == answer_tokens))
            continue
        overlap = sum((Counter(prediction_tokens) & Counter(answer_tokens)).values())
        if overlap == 0:
            continue
        precision = overlap / len(prediction_tokens)
        recall = overlap / len(answer_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def text_retained(fragment: str, context_normalized: str) -> bool:
    """Is this passage fragment (sentence) present, modulo normalization, in the sent context?"""
    normalized = normalize_answer(fragment)
    return bool(normalized) and normalized in context_normalized
