"""Exact (normalized hash) and near-duplicate (embedding cosine) removal."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from compression.text import content_hash, normalize_for_dedup


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
    for index in order:
        normalized = normalize_for_dedup(texts[index])
        if not normalized:
            continue  # punctuation-only units are left to the budget, not called duplicates
        if exact:
            key = content_hash(normalized)
            if key in seen_hashes:
                dropped.add(index)
                continue
            seen_hashes.add(key)
        if near_cosine is not None and vectors is not None and kept:
            similarities = vectors[kept] @ vectors[index]
            if float(similarities.max()) >= near_cosine:
                dropped.add(index)
                continue
        kept.append(index)
    return dropped
