"""A Llama-family decoder (Llama, Mistral, SmolLM, Qwen2) in plain PyTorch.

The model works on a flat batch: all scheduled tokens of all sequences are concatenated into one
row of `num_tokens`, so a step mixing decodes and prefill chunks is one set of matrix multiplies.
Attention (the only part that needs to know which token belongs to which sequence) is delegated
to an attention backend that reads and writes the paged KV cache.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from backend.attention import AttentionBackend, AttentionMetadata
    from backend.kv_cache import KVCache


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


def _mkldnn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


# Up to this many rows the C++ GEMV (backend/csrc) beats oneDNN: measured 1.4x at 1 row and
# 1.5x at 2 rows with 2 threads, slower from 4 rows on.
GEMV_MAX_ROWS = 2
# int4 weights (torch's int4pack CPU kernel) for up to this many rows: 1.9x faster than the bf16
# GEMV at 1 row, 1.7x at 2; at 16 rows it is slower than oneDNN's bf16 GEMM, so prefill keeps bf16.
INT4_MAX_ROWS = 2
INT4_GROUP_SIZE = 32


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization in groups along the input dimension.

    Returns torch's packed int4 CPU layout and the [in / group, out, 2] (scale, zero) tensor in the
    weight's dtype, for `w = (q - 8) * scale + zero`. With min/max grids this recovers a Q4_1
    (d * q + m) weight exactly, up to rounding the scales to bfloat16.
    """
    out_features, in_features = weight.shape
    grouped = weight.float().view(out_features, in_features // group_size, group_size)
    low = grouped.amin(dim=-1, keepdim=True)
    high = grouped.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp_min(1e-10)
    q = ((grouped - low) / scale).round_().clamp_(0, 15).to(torch.int32).view(out_features, in_features)
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros.to(weight.dtype)


class Linear(nn.Linear):
    """nn.Linear that can switch to oneDNN prepacked weights on CPU, and to a GEMV kernel for decode.

    torch's default CPU bfloat16 GEMV/GEMM path reaches only a fraction of memory bandwidth at the
    small batch sizes of decoding; oneDNN with weights reordered once at load time measured ~2x
    faster for batch 1 here, with bit-identical results in bfloat16. For one or two rows the
    C++ kernel streams the plain weight faster still.
    """

    packed_weight: torch.Tensor | None = None
    use_gemv_kernel: bool = False
    int4_weight: torch.Tensor | None = None
    int4_scales_and_zeros: torch.Tensor | None = None

    def prepack(self) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)

    def quantize_int4(self) -> bool:
        if self.in_features % INT4_GROUP_SIZE or self.weight.dtype != torch.bfloat16:
            return False
        self.int4_weight, self.int4_scales_and_zeros = quantize_int4(self.weight)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4_weight is not None and x.shape[0] <= INT4_MAX_ROWS:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.int4_weight, INT4_GROUP_SIZE, self.int4_scales_and_zeros
            )
            return out if self.bias is None else out + self.bias
        if self.use_gemv_kernel and x.shape[0] <= GEMV_MAX_ROWS and self.bias is None:
            return torch.ops.ctxgate_cpu.gemv_bf16(x, self.weight)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, then scale in the model dtype.
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_index: int, qkv_bias: bool):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # Q, K and V (and gate/up) are fused into one matrix each: fewer, larger matmuls per step.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.intermediate_size = config.intermediate_size

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(hidden))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = attention.forward(self.layer_index, q, k, v, kv_cache, metadata)
        hidden = hidden + self.o_proj(attn.reshape(num_tokens, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(hidden)).split(
            self.intermediate_size, dim=-1
        )
        return hidden + self.down_proj(F.silu(gate) * up)

    def forward_fused(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer through the C++ elementwise kernels (bfloat16 on CPU).

        The MLP output is returned as `delta` instead of being added, so the next layer adds it
        in the same pass as its input norm. Returns (hidden, delta); hidden + delta is the output.
        """
        ops = torch.ops.ctxgate_cpu
        num_tokens = hidden.shape[0]
        eps = self.input_layernorm.eps
        if delta is None:
            normed = ops.rms_norm(hidden, self.input_layernorm.weight, eps)
        else:
            normed, hidden = ops.add_rms_norm(hidden, delta, self.input_layernorm.weight, eps)
        qkv = self.qkv_proj(normed)
        q, k = ops.rotary_qk(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = attention.forward(self.layer_index, q, k, v, kv_cache, metadata)
        attn_out = self.o_proj(attn.reshape(num_tokens, self.q_size))
        normed, hidden = ops.add_rms_norm(hidden, attn_out, self.post_attention_layernorm.weight, eps)
        return hidden, self.down_proj(ops.silu_and_mul(self.gate_up_proj(normed)))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig, qkv_bias: bool = False):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, qkv_bias) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryTable | None = None
        self.packed_lm_head: torch.Tensor | None = None
        self.use_gemv_kernel = False
        self.use_fused_layers = False

    def prepack_for_cpu(self) -> bool:
        """Reorder bfloat16 weights for oneDNN (CPU only); returns whether it was done."""
        weight = self.embed_tokens.weight
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not _mkldnn_packing_available():
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        self.packed_lm_head = torch.ops.mkldnn._reorder_linear_weight(self.lm_head_matrix(), 1)
        return True

    def quantize_weights_int4(self) -> int:
        """Add 4-bit copies of the decoder's linear weights (the LM head stays bf16); returns how many."""
        weight = self.embed_tokens.weight
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            raise ValueError("int4 weights need bfloat16 on CPU (torch's int4pack CPU kernel)")
        return sum(module.quantize_int4() for module in self.modules() if isinstance(module, Linear))

    def enable_cpu_kernels(self) -> bool:
        """Route decode-sized bfloat16 matmuls to the C++ GEMV; returns whether it was enabled."""
        from backend import cpu_kernels

        weight = self.embed_tokens.weight
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not cpu_kernels.load():
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_gemv_kernel = True
        self.use_gemv_kernel = True
        self.use_fused_layers = True
        return True

    def init_rotary(self, max_positions: int) -> None:
        weight = self.embed_tokens.weight
        self.rotary = RotaryTable(self.config, max_positions, weight.device, weight.dtype)

    def lm_head_matrix(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Float32 logits for the rows `logits_indices` of the flat token batch."""
        assert self.rotary is not None, "call init_rotary first"
        cos, sin = self.rotary.lookup(positions)
        hidden = self.embed_tokens(input_ids)
        if self.use_fused_layers:
            delta: torch.Tensor | None = None
            for layer in self.layers:
                hidden, delta = layer.forward_fused(hidden, delta, cos, sin, attention, kv_cache, metadata)
            if delta is not None:
                hidden = hidden + delta
        else:
            for layer in self.layers:
                hidden = layer(hidden, cos, sin, attention, kv_cache, metadata)
        last = self.norm(hidden.index_select(0, logits_indices))
        if self.use_gemv_kernel and last.shape[0] <= GEMV_MAX_ROWS:
            logits = torch.ops.ctxgate_cpu.gemv_bf16(last, self.lm_head_matrix())
        elif self.packed_lm_head is not None:
            logits = torch.ops.mkldnn._linear_pointwise(last, self.packed_lm_head, None, "none", [None], "")
        else:
            logits = F.linear(last, self.lm_head_matrix())
        return logits.float()


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
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    model.requires_grad_(False)
    model.prepack_for_cpu()
    model.enable_cpu_kernels()
    if weight_quant == "int4":
        model.quantize_weights_int4()
    return model
