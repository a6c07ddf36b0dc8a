"""Answer scoring, evidence retention, percentiles and bootstrap confidence intervals.

Answer normalization follows the usual open-domain QA convention (SQuAD): lower-case, drop
punctuation and the articles a/an/the, collapse whitespace. Accuracy is "a gold answer is contained
in the normalized reply" — the metric the lost-in-the-middle and LongLLMLingua papers report.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

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


# --- summaries -------------------------------------------------------------------------------


def percentiles(values: Sequence[float], points: Sequence[int] = (50, 95, 99)) -> dict[str, float | None]:
    finite = [value for value in values if value is not None and np.isfinite(value)]
    summary: dict[str, float | None] = {}
    for point in points:
        summary[f"p{point}"] = round(float(np.percentile(finite, point)), 3) if finite else None
    summary["mean"] = round(float(np.mean(finite)), 3) if finite else None
    return summary


@dataclass
class Estimate:
    """A mean with a percentile-bootstrap confidence interval."""

    value: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    confidence: float = 0.95

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)

    @property
    def excludes_zero(self) -> bool:
        return self.ci_low is not None and self.ci_high is not None and (self.ci_low > 0 or self.ci_high < 0)


def _resample_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap_mean(
    values: Sequence[float], resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> Estimate:
    data = np.asarray([value for value in values if value is not None], dtype=float)
    if data.size == 0:
        return Estimate(None, None, None, 0, confidence)
    means = data[_resample_indices(data.size, resamples, seed)].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    return Estimate(
        value=round(float(data.mean()), 6),
        ci_low=round(float(np.percentile(means, tail)), 6),
        ci_high=round(float(np.percentile(means, 100 - tail)), 6),
        n=int(data.size),
        confidence=confidence,
    )


def paired_bootstrap_difference(
    baseline: dict[str, float | None],
    candidate: dict[str, float | None],
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """candidate - baseline over the questions both scored (paired by question id), with a bootstrap
    interval that resamples questions, so per-question difficulty cancels out."""
    shared_ids = sorted(
        key for key in baseline.keys() & candidate.keys()
        if baseline[key] is not None and candidate[key] is not None
    )
    differences = [float(candidate[key]) - float(baseline[key]) for key in shared_ids]  # type: ignore[arg-type]
    return bootstrap_mean(differences, resamples=resamples, confidence=confidence, seed=seed)
