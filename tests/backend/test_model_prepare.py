import json

import numpy as np

from backend.gguf_convert import undo_rope_permutation
from backend.model_prepare import prepare_default_model


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # The permutation llama.cpp's converter applies to Q/K rows (written out here as the spec).
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_undo_rope_permutation_inverts_llama_cpp_layout():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3 * 64, 10)).astype(np.float32)
    assert np.array_equal(undo_rope_permutation(_llama_cpp_permute(weight, 3), 3), weight)


def test_default_model_directory_has_model_facts(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert (model_dir / "tokenizer.json").exists()
    # Idempotent: a second call reuses the cached directory untouched.
    mtime = (model_dir / "model.safetensors").stat().st_mtime
    assert prepare_default_model() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime == mtime


def test_converted_model_answers_sensibly(model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0][len(prompt_ids) :].tolist())
