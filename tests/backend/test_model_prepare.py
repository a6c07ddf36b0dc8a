import json

from ctxgate.backend.model.model_prepare import prepare_default_model


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
