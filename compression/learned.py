"""A sentence's relevance as a fitted combination of ctxgate.compression.sentence_features (extraction.scorer
"learned").

Rule: the score is a linear function of the features fitted as a softmax over each question's
sentences (the log of the chance that this sentence is the one holding the answer, up to a constant
of the question; a sentence holds the answer when keeping it puts the answer in the prompt: in its
text, or in its passage's title, rendered above it), in two rounds: the first on the sentence's own
features, the second adding what the first round's best sentences point to
(ctxgate.compression.sentence_features.hop_features: a multi-hop question's next passage). It is used
times the knapsack's value temperature, so a unit's knapsack value (ctxgate.compression.scoring.values_from_scores) is its chance relative to the best sentence's. The
weights were fitted on the tune halves of the dev sets only (the test halves, grouped by shared gold
passages, are never read by the fit): `python -m ctxgate.eval.fit_scorer` reproduces them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ctxgate.compression.scoring import VALUE_TEMPERATURE
from ctxgate.compression.sentence_features import FEATURES, HOP_FEATURES, hop_features
from ctxgate.compression.state import Passage

# Fitted by `python -m ctxgate.eval.fit_scorer` (tune halves of NQ, HotpotQA and MuSiQue; L2 1/100, chosen on
# halves of the tune questions); order: FEATURES and HOP_FEATURES.
WEIGHTS: tuple[float, ...] = (
    0.5694,
    1.0474,
    0.6525,
    1.3320,
    1.3097,
    0.8134,
    1.1578,
    0.5109,
    -0.1954,
    -0.0932,
    1.5322,
    1.0174,
)
HOP_WEIGHTS: tuple[float, ...] = (-0.0768, 1.6342, 0.4992)


def first_round(features: np.ndarray, weights: Sequence[float] = WEIGHTS) -> np.ndarray:
    """The first round's log-chances."""
    if len(weights) != features.shape[1] or len(weights) != len(FEATURES):
        raise ValueError(f"{len(weights)} weights for {features.shape[1]} features")
    return features @ np.asarray(weights, dtype=np.float64)


def learned_scores(
    question: str,
    passages: Sequence[Passage],
    positions: Sequence[tuple[int, int, str]],
    features: np.ndarray,
    weights: Sequence[float] = WEIGHTS,
    hop_weights: Sequence[float] = HOP_WEIGHTS,
) -> np.ndarray:
    """Scores on the knapsack's scale: both rounds' log-chance x VALUE_TEMPERATURE."""
    if len(hop_weights) != len(HOP_FEATURES):
        raise ValueError(f"{len(hop_weights)} hop weights for {len(HOP_FEATURES)} features")
    first = first_round(features, weights)
    hop = hop_features(question, passages, positions, first) @ np.asarray(hop_weights, dtype=np.float64)
    return VALUE_TEMPERATURE * (first + hop)
