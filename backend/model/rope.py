"""Rotary position embeddings: the config's frequency scaling and the per-position cos/sin table."""

from __future__ import annotations

import math

import torch

from ctxgate.backend.model.model_config import ModelArchConfig


def rope_inverse_frequencies(config: ModelArchConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies after the config's RoPE scaling, and the attention scaling factor."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq, 1.0
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are interpolated by `factor`, short ones kept, the middle band blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryTable:
    """cos/sin for every position, computed once in float32 and indexed per step."""

    def __init__(self, config: ModelArchConfig, max_positions: int, device: torch.device, dtype: torch.dtype):
        inv_freq, attention_factor = rope_inverse_frequencies(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_factor).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention_factor).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin shaped [num_tokens, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
