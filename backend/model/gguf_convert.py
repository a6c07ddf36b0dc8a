"""Convert a GGUF file of a supported architecture into a Hugging Face model directory.

The directory (config.json, model.safetensors, tokenizer files with the chat template) holds the
weights dequantised to float32: exactly the values llama.cpp multiplies with, so the engine and a
float32 Hugging Face `generate` run on the same numbers. The file's architecture and every tensor's
type are checked from the header before any tensor data is read, so an unsupported file is refused
at once with a message naming what it has.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctxgate.backend.model.conversion_progress import ConversionProgress, LoggedProgress

# Bumped whenever the conversion changes, so stale cached directories are rebuilt.
CONVERTER_VERSION = 1

# GGUF architecture -> (HF architecture, model_type). llama.cpp writes Llama 1-3, Mistral and
# SmolLM as "llama" (Q/K rows permuted for its rotary layout); Qwen2 and Qwen2.5 as "qwen2".
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
# Tensor types dequantised through the `gguf` package's numpy dequantisers.
SUPPORTED_TENSOR_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
)


class UnsupportedModelError(ValueError):
    """The file's architecture or one of its tensor types is not one the engine can run."""


@dataclass(frozen=True)
class GGUFModelFacts:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_positions: int
    rms_norm_eps: float
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int | None


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def check_supported(reader: Any, path: Path) -> str:
    """The file's architecture, after checking it and every tensor type from the header alone."""
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture {arch!r} is not supported by the built-in engine "
            f"(supported: {', '.join(sorted(SUPPORTED_GGUF_ARCHITECTURES))})"
        )
    unsupported = sorted({t.tensor_type.name for t in reader.tensors} - SUPPORTED_TENSOR_TYPES)
    if unsupported:
        raise UnsupportedModelError(
            f"{path.name}: tensor type(s) {', '.join(unsupported)} not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_TENSOR_TYPES))})"
        )
    return arch


def _rope_scaling(reader: Any, arch: str, head_dim: int, rope_theta: float) -> dict[str, Any] | None:
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field_value(reader, f"{arch}.rope.scaling.factor"))}
    if kind not in (None, "none"):
        raise UnsupportedModelError(
            f"rope scaling type {kind!r} is not supported (supported: linear, llama3)"
        )
    # Llama 3.1+ files carry their llama3 scaling as per-frequency divisors (`rope_freqs.weight`).
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    from ctxgate.backend.model.rope_fit import fit_llama3_scaling

    original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    return fit_llama3_scaling(np.asarray(freqs.data, dtype=np.float64), head_dim, rope_theta, original)


def read_facts(reader: Any, arch: str) -> GGUFModelFacts:
    tokens_field = reader.fields["tokenizer.ggml.tokens"]
    pad = field_value(reader, "tokenizer.ggml.padding_token_id")
    hidden = int(field_value(reader, f"{arch}.embedding_length"))
    num_heads = int(field_value(reader, f"{arch}.attention.head_count"))
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rope_theta = float(field_value(reader, f"{arch}.rope.freq_base", 10000.0))
    return GGUFModelFacts(
        architecture=arch,
        num_layers=int(field_value(reader, f"{arch}.block_count")),
        hidden_size=hidden,
        intermediate_size=int(field_value(reader, f"{arch}.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(field_value(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        vocab_size=len(tokens_field.data),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, rope_theta),
        max_positions=int(field_value(reader, f"{arch}.context_length")),
        rms_norm_eps=float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        bos_token_id=int(field_value(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(field_value(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(pad) if pad is not None else None,
    )


def undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves the two rotary halves of each Q/K head of "llama" files; restore HF's layout."""
    head_half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, head_half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Carried in the config (rope_scaling) instead of as a weight.
_SKIPPED = {"rope_freqs.weight"}


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r} for this architecture")


def convert_weights(
    reader: Any, facts: GGUFModelFacts, progress: ConversionProgress | None = None
) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    permuted = facts.architecture == "llama"
    tensors: dict[str, np.ndarray] = {}
    for tensor in (progress or LoggedProgress()).tensors(reader.tensors, "dequantizing weights"):
        if tensor.name in _SKIPPED:
            continue
        name = hf_tensor_name(tensor.name)
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        # GGML lists dimensions fastest-first; numpy wants them slowest-first.
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = undo_rope_permutation(array, facts.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = undo_rope_permutation(array, facts.num_kv_heads)
        tensors[name] = np.ascontiguousarray(array)
    return tensors


def hf_config(facts: GGUFModelFacts, tied: bool, qkv_bias: bool, source: str) -> dict[str, Any]:
    architecture, model_type = SUPPORTED_GGUF_ARCHITECTURES[facts.architecture]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": facts.hidden_size,
        "intermediate_size": facts.intermediate_size,
        "num_hidden_layers": facts.num_layers,
        "num_attention_heads": facts.num_heads,
        "num_key_value_heads": facts.num_kv_heads,
        "head_dim": facts.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": facts.max_positions,
        "rms_norm_eps": facts.rms_norm_eps,
        "rope_theta": facts.rope_theta,
        "rope_scaling": facts.rope_scaling,
        "vocab_size": facts.vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": facts.bos_token_id,
        "eos_token_id": facts.eos_token_id,
        "pad_token_id": facts.pad_token_id,
        "torch_dtype": "float32",
        "ctxgate_converter_version": CONVERTER_VERSION,
        "ctxgate_source": source,
    }
    if model_type == "llama":
        config.update(attention_bias=qkv_bias, mlp_bias=False)
    else:  # Qwen2 always has Q/K/V biases; its sliding window is off in every released config
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=facts.num_layers)
    return config


def write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    # transformers converts the GGUF vocabulary, merges and chat template into a fast tokenizer.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise UnsupportedModelError(
            f"{gguf_path.name}: the file carries no chat template (tokenizer.chat_template)"
        )
    tokenizer.save_pretrained(str(out_dir))


def is_complete(model_dir: Path) -> bool:
    config_path = model_dir / "config.json"
    if not (config_path.exists() and (model_dir / "model.safetensors").exists()):
        return False
    if not (model_dir / "tokenizer.json").exists():
        return False
    config = json.loads(config_path.read_text())
    return config.get("ctxgate_converter_version") == CONVERTER_VERSION


def open_checked(gguf_path: Path) -> tuple[Any, str]:
    """The file's reader and architecture, refused before any tensor is read if unsupported."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))  # memory-maps the file: reads the header only
    return reader, check_supported(reader, gguf_path)


def convert_gguf(gguf_path: Path, out_dir: Path, progress: ConversionProgress | None = None) -> Path:
    """Convert one GGUF file into an HF directory at out_dir (atomically), saying each step."""
    from safetensors.numpy import save_file

    progress = progress or LoggedProgress()

    reader, arch = open_checked(gguf_path)
    facts = read_facts(reader, arch)
    progress.step(f"read {gguf_path.name}: {arch}, {facts.num_layers} layers, {len(reader.tensors)} tensors")
    tensors = convert_weights(reader, facts, progress)
    tied = "lm_head.weight" not in tensors
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in tensors
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir.parent))
    try:
        megabytes = sum(array.nbytes for array in tensors.values()) / 2**20
        progress.step(f"writing model.safetensors ({megabytes:.0f} MiB of float32 weights)")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        config = hf_config(facts, tied, qkv_bias, gguf_path.name)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        generation_config = {"bos_token_id": facts.bos_token_id, "eos_token_id": facts.eos_token_id}
        (staging / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
        progress.step("building the tokenizer and chat template from the file (transformers)")
        write_tokenizer(gguf_path, staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir
