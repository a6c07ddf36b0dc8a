"""Recover Llama 3's RoPE scaling parameters from the per-frequency factors a GGUF file stores.

llama.cpp's converter does not write `rope_scaling` for Llama 3.1+; it writes `rope_freqs.weight`,
one divisor per rotary frequency: 1 for short wavelengths, `factor` for long ones and a smooth
blend between. The blend is linear in 1 / wavelength, so two blended frequencies fix it; the
fitted parameters are checked by recomputing every divisor, and a file they do not reproduce is
refused instead of served with the wrong positions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

DEFAULT_ORIGINAL_CONTEXT = 8192  # Llama 3's pre-training context, what the 3.1+ configs name


def llama3_factors(
    head_dim: int, theta: float, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """The divisors llama.cpp writes for these llama3 parameters (its converter's formula)."""
    freqs = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


def fit_llama3_scaling(
    factors: np.ndarray, head_dim: int, theta: float, original: float | None
) -> dict[str, Any]:
    from ctxgate.backend.model.gguf_convert import UnsupportedModelError

    original = float(original or DEFAULT_ORIGINAL_CONTEXT)
    factor = float(factors.max())
    params = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    freqs = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    blended = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if factor > 1 and blended.sum() >= 2:
        # smooth = 1/factors blended back out, = a / wavelength + b with a = original / (high - low).
        smooth = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(freqs[blended] / (2 * math.pi), smooth, 1)
        span = original / a
        params["low_freq_factor"] = float(-b * span)
        params["high_freq_factor"] = float(-b * span + span)
    expected = llama3_factors(
        head_dim, theta, factor, params["low_freq_factor"], params["high_freq_factor"], original
    )
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-4):
        raise UnsupportedModelError(
            "rope_freqs.weight does not follow llama3 rope scaling; cannot convert it"
        )
    return {"rope_type": "llama3", "original_max_position_embeddings": int(original), **params}
