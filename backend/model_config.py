"""The architecture facts of a Llama-family checkpoint, read from its Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class ModelArchConfig:
    """The architecture facts read from the HF config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    model_type: str

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> ModelArchConfig:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        # transformers 5 moved rope settings into `rope_parameters`; older configs use rope_scaling.
        rope_params = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            model_type=raw.get("model_type", "llama"),
        )
