"""Models at real shapes with seeded random weights, written as Hugging Face safetensors directories.

No weights travel to the GPU machine: a shape is a config in eval/gpu/configs/ (the real HF fields),
the tokenizer is SmolLM2's (eval/gpu/tokenizers/smollm2), and the weights are drawn here. Speed does
not depend on weight values; correctness is checked against transformers on these same weights.
The 8B shape is 16 GB in bfloat16: tensors are drawn one at a time (on the GPU when there is one)
and written in shards of about 1 GiB, so the host never holds more than one shard.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"
SMOLLM2_TOKENIZER = HERE / "tokenizers" / "smollm2"
MINILM_FILES = HERE / "tokenizers" / "minilm"
SHAPES = ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b")
SHARD_BYTES = 1 << 30
# Final-norm gain so that logits have a standard deviation of about this much: wide top-2 gaps make
# greedy decoding robust to bfloat16 rounding, as a trained model's confident steps are.
LOGIT_STD = 4.0


def shape_config(shape: str) -> dict:
    raw = json.loads((CONFIGS / f"{shape}.json").read_text())
    return {key: value for key, value in raw.items() if not key.startswith("_")}


def parameter_count(config: dict) -> int:
    return sum(math.prod(shape) for _, shape, _ in tensor_specs(config))


def tensor_specs(config: dict) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(HF tensor name, shape, init kind) for a Llama-family checkpoint; Qwen2 has Q/K/V biases."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    bias = config["model_type"] == "qwen2" or bool(config.get("attention_bias"))
    yield "model.embed_tokens.weight", (vocab, hidden), "normal"
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows in (
            ("q_proj", heads * head_dim),
            ("k_proj", kv_heads * head_dim),
            ("v_proj", kv_heads * head_dim),
        ):
            yield f"{p}self_attn.{name}.weight", (rows, hidden), "normal"
            if bias:
                yield f"{p}self_attn.{name}.bias", (rows,), "normal"
        yield f"{p}self_attn.o_proj.weight", (hidden, heads * head_dim), "normal"
        yield f"{p}mlp.gate_proj.weight", (inter, hidden), "normal"
        yield f"{p}mlp.up_proj.weight", (inter, hidden), "normal"
        yield f"{p}mlp.down_proj.weight", (hidden, inter), "normal"
        yield f"{p}input_layernorm.weight", (hidden,), "ones"
        yield f"{p}post_attention_layernorm.weight", (hidden,), "ones"
    yield "model.norm.weight", (hidden,), "final_norm"
    if not config.get("tie_word_embeddings"):
        yield "lm_head.weight", (vocab, hidden), "normal"


def _draw(name: str, shape: tuple[int, ...], kind: str, config: dict, seed: int, device: Any) -> Any:
    import torch

    std = float(config.get("initializer_range", 0.02))
    if kind == "ones":
        return torch.ones(shape, dtype=torch.bfloat16)
    if kind == "final_norm":
        return torch.full(shape, LOGIT_STD / (std * math.sqrt(config["hidden_size"])), dtype=torch.bfloat16)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 1_000_003 + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    values = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=generator)
    return values.cpu()


def _fingerprint(config: dict, seed: int) -> str:
    return hashlib.sha256(json.dumps([config, seed], sort_keys=True).encode()).hexdigest()[:16]


def build_model(
    shape: str,
    out_dir: str | Path,
    seed: int = 0,
    device: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write `shape` with seeded random bfloat16 weights to `out_dir` (kept if already built alike);
    `overrides` change config fields (the tests shrink the layer count)."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    config = shape_config(shape) | (overrides or {})
    # The tokenizer is SmolLM2's whatever the shape: its special ids are the ones generation stops on.
    config.update(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    stamp = out / ".ctxgate-random"
    fingerprint = _fingerprint(config, seed)
    if stamp.is_file() and stamp.read_text() == fingerprint:
        return out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    weight_map: dict[str, str] = {}
    shards: list[list[str]] = []
    pending: dict[str, Any] = {}
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(pending, str(out / name), metadata={"format": "pt"})
        shards.append(list(pending))
        weight_map.update(dict.fromkeys(pending, name))
        pending, pending_bytes = {}, 0

    for name, tensor_shape, kind in tensor_specs(config):
        pending[name] = _draw(name, tensor_shape, kind, config, seed, target)
        pending_bytes += pending[name].numel() * 2
        if pending_bytes >= SHARD_BYTES:
            flush()
    if pending:
        flush()
    total = sum(math.prod(shape) * 2 for _, shape, _ in tensor_specs(config))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    for file in SMOLLM2_TOKENIZER.iterdir():
        shutil.copy(file, out / file.name)
    stamp.write_text(fingerprint)
    return out


def build_embedder(out_dir: str | Path, seed: int = 0) -> Path:
    """A sentence-transformers directory at all-MiniLM-L6-v2's shape with random weights (cost only)."""
    import torch
    from transformers import BertConfig, BertModel

    out = Path(out_dir)
    stamp = out / ".ctxgate-random"
    if stamp.is_file() and stamp.read_text() == str(seed):
        return out
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(MINILM_FILES, out)
    raw = json.loads((CONFIGS / "minilm-l6.json").read_text())
    config = BertConfig(**{key: value for key, value in raw.items() if not key.startswith("_")})
    torch.manual_seed(seed)
    BertModel(config).eval().save_pretrained(str(out), safe_serialization=True)
    stamp.write_text(str(seed))
    return out
