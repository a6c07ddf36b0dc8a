"""The architecture facts of a Llama-family checkpoint, read from its Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The HF architectures this decoder implements (Mistral checkpoints declare MistralForCausalLM; SmolLM
# and Llama 1-3 LlamaForCausalLM; Qwen2 and Qwen2.5 Qwen2ForCausalLM).
SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class UnsupportedArchitectureError(ValueError):
    """A model directory whose architecture the engine does not implement."""


def check_hf_architecture(model_dir: str | Path) -> None:
    """Refuse a directory of another architecture, naming it, before any weight is read."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    names = raw.get("architectures") or [raw.get("model_type", "?")]
    if not any(name in SUPPORTED_HF_ARCHITECTURES for name in names):
        raise UnsupportedArchitectureError(
            f"{Path(model_dir).name}: architecture {', '.join(map(str, names))} is not supported by the built-in "
            f"engine (supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)})"
        )
    if raw.get("use_sliding_window"):
        raise UnsupportedArchitectureError(
            f"{Path(model_dir).name}: sliding-window attention is not supported"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(
            f"{Path(model_dir).name}: activation {raw['hidden_act']!r} is not supported"
        )


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
        max_positions = raw.get("max_position_embeddings", 4096)
        if raw.get("model_type") == "mistral" and raw.get("sliding_window"):
            # Full attention equals Mistral's sliding window up to the window: serve no further.
            max_positions = min(max_positions, raw["sliding_window"])
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
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            model_type=raw.get("model_type", "llama"),
        )
