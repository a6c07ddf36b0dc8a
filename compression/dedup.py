"""Exact (normalized hash) and near-duplicate (embedding cosine) removal.

Two units that state different numbers are never near-duplicates, however close their vectors: "It
has a Roud Folk Song Index number of 821." and "... of 5040." embed almost alike, yet each is the
only place its fact is stated (the other passage's rhyme has another number).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from ctxgate.compression.fair import yield_turn
from ctxgate.compression.text import content_hash, normalize_for_dedup

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def numbers_in(text: str) -> frozenset[str]:
    """The numbers a text states ("1,045", "2001", "3.5"), as written."""
    return frozenset(_NUMBER.findall(text))


YIELD_EVERY_UNITS = 256


def duplicate_indices(
    texts: Sequence[str],
    vectors: np.ndarray | None = None,
    exact: bool = True,
    near_cosine: float | None = None,
    priority: Sequence[float] | None = None,
) -> set[int]:
    """Indices to drop. Within a duplicate group the unit with the highest priority survives
    (ties: the earliest), so a duplicate never pushes out the better-ranked copy."""
    order = list(range(len(texts)))
    if priority is not None:
        order.sort(key=lambda i: (-priority[i], i))
    dropped: set[int] = set()
    seen_hashes: set[str] = set()
    kept: list[int] = []
    # The kept units' vectors, in keeping order: the same rows `vectors[kept]` would copy out at
    # every unit (one matrix-vector product each, so the cosines and the choices are unchanged).
    kept_vectors = np.empty_like(vectors) if near_cosine is not None and vectors is not None else None
    for step, index in enumerate(order):
        if step % YIELD_EVERY_UNITS == YIELD_EVERY_UNITS - 1:
            yield_turn()  # quadratic in the units: a huge document's loop lets other tenants in
        normalized = normalize_for_dedup(texts[index])
        if not normalized:
            continue  # punctuation-only units are left to the budget, not called duplicates
        if exact:
            key = content_hash(normalized)
            if key in seen_hashes:
                dropped.add(index)
                continue
            seen_hashes.add(key)
        if kept_vectors is not None and kept:
            similarities = kept_vectors[: len(kept)] @ vectors[index]
            if float(similarities.max()) >= near_cosine and any(
                numbers_in(texts[kept[k]]) == numbers_in(texts[index])
                for k in np.flatnonzero(similarities >= near_cosine)
            ):
                dropped.add(index)
                continue
        if kept_vectors is not None:
            kept_vectors[len(kept)] = vectors[index]
        kept.append(index)
    return dropped
