"""Builds a LlamaModel from a Hugging Face directory and sets it up for the CPU it runs on."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ctxgate.backend.model.linear import MatmulPlan, configure_matmuls
from ctxgate.backend.model.llama import LlamaModel
from ctxgate.backend.model.model_config import ModelArchConfig
from ctxgate.backend.platform.cpu_features import cpu_path

logger = logging.getLogger(__name__)


def _fused_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, weight_quant: str = "none"
) -> LlamaModel:
    """Build the model and load its safetensors weights (Q/K/V and gate/up fused on load)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = ModelArchConfig.from_hf_dir(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                raw[name] = handle.get_tensor(name)
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in raw
    with torch.device("meta"):
        model = LlamaModel(config, qkv_bias=qkv_bias)
    state: dict[str, torch.Tensor] = {
        "embed_tokens.weight": raw["model.embed_tokens.weight"],
        "norm.weight": raw["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = raw.get("lm_head.weight", raw["model.embed_tokens.weight"])
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        attn = prefix + "self_attn."
        state[f"layers.{i}.qkv_proj.weight"] = _fused_rows(
            [raw[attn + "q_proj.weight"], raw[attn + "k_proj.weight"], raw[attn + "v_proj.weight"]]
        )
        if qkv_bias:
            state[f"layers.{i}.qkv_proj.bias"] = _fused_rows(
                [raw[attn + "q_proj.bias"], raw[attn + "k_proj.bias"], raw[attn + "v_proj.bias"]]
            )
        state[f"layers.{i}.o_proj.weight"] = raw[attn + "o_proj.weight"]
        state[f"layers.{i}.gate_up_proj.weight"] = _fused_rows(
            [raw[prefix + "mlp.gate_proj.weight"], raw[prefix + "mlp.up_proj.weight"]]
        )
        state[f"layers.{i}.down_proj.weight"] = raw[prefix + "mlp.down_proj.weight"]
        state[f"layers.{i}.input_layernorm.weight"] = raw[prefix + "input_layernorm.weight"]
        state[f"layers.{i}.post_attention_layernorm.weight"] = raw[prefix + "post_attention_layernorm.weight"]
    state = {name: tensor.to(device=device, dtype=dtype) for name, tensor in state.items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]  # the same tensor, not a copy
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    model.requires_grad_(False)
    model.matmul_plan = configure_for_device(model, device, weight_quant)
    return model


def configure_for_device(model: LlamaModel, device: torch.device, weight_quant: str = "none") -> MatmulPlan:
    """Pick the kernels for this device and CPU path: C++ kernels for bfloat16 on CPU, the matmul
    dispatch of every Linear, and int4 copies of the decoder's weights (the LM head stays 16-bit)."""
    from ctxgate.backend.model import cpu_kernels

    path = cpu_path()
    on_cpu_bf16 = device.type == "cpu" and model.embed_tokens.weight.dtype == torch.bfloat16
    kernels_loaded = on_cpu_bf16 and cpu_kernels.load()
    model.use_fused_layers = kernels_loaded
    int4 = model.decoder_linears() if weight_quant == "int4" else []
    plan = configure_matmuls(model.linears(), path, kernels_loaded, device, int4)
    logger.info("matmuls: %s (%s)", plan.summary(), path.summary())
    return plan
