"""A Llama-family decoder (Llama, Mistral, SmolLM, Qwen2) in plain PyTorch.

The model works on a flat batch: all scheduled tokens of all sequences are concatenated into one
row of `num_tokens`, so a step mixing decodes and prefill chunks is one set of matrix multiplies.
Attention (the only part that needs to know which token belongs to which sequence) is delegated
to an attention backend that reads and writes the paged KV cache. Which kernel runs each matmul is
`backend/model/linear.py`'s business; the config is `backend/model/model_config.py`, RoPE `backend/model/rope.py`,
the weight loading `backend/model/model_loader.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ctxgate.backend.model.linear import Linear, MatmulPlan
from ctxgate.backend.model.model_config import ModelArchConfig
from ctxgate.backend.model.rope import RotaryTable, apply_rotary

if TYPE_CHECKING:
    from collections.abc import Callable

    from ctxgate.backend.model.attention import AttentionBackend, AttentionMetadata
    from ctxgate.backend.model.kv_cache import KVCache


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
        # With tied embeddings the loader assigns the embedding matrix to lm_head.weight.
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryTable | None = None
        self.use_fused_layers = False  # the C++ elementwise kernels (bfloat16 on CPU)
        self.matmul_plan: MatmulPlan | None = None  # set by ctxgate.backend.model.model_loader
        # Called between two decoder layers: a long prefill step lets side work queued meanwhile
        # (AsyncEngine.run_between_steps) start within one layer's time instead of the whole step's.
        self.between_layers: Callable[[], None] | None = None

    def linears(self) -> list[Linear]:
        return [module for module in self.modules() if isinstance(module, Linear)]

    def decoder_linears(self) -> list[Linear]:
        return [module for module in self.layers.modules() if isinstance(module, Linear)]

    def init_rotary(self, max_positions: int) -> None:
        weight = self.embed_tokens.weight
        self.rotary = RotaryTable(self.config, max_positions, weight.device, weight.dtype)

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
                if self.between_layers is not None:
                    self.between_layers()
            if delta is not None:
                hidden = hidden + delta
        else:
            for layer in self.layers:
                hidden = layer(hidden, cos, sin, attention, kv_cache, metadata)
                if self.between_layers is not None:
                    self.between_layers()
        last = self.norm(hidden.index_select(0, logits_indices))
        return self.lm_head(last).float()
