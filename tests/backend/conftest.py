"""Engine-test fixtures: the parity prompts and their Hugging Face greedy reference (once per session)."""

from __future__ import annotations

import pytest

from tests.backend.engine_fixtures import PARITY_MAX_TOKENS, PARITY_TEXTS


@pytest.fixture(scope="session")
def parity_prompts(tokenizer) -> list[list[int]]:
    prompts = [tokenizer.encode(text) for text in PARITY_TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts must have different lengths"
    return prompts


@pytest.fixture(scope="session")
def hf_greedy_reference(model_dir, parity_prompts) -> list[list[int]]:
    """Hugging Face transformers' greedy continuation of each prompt, float32 weights."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # see make_engine: robust against busy neighbours on a 2-core box
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for prompt in parity_prompts:
            generated = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=PARITY_MAX_TOKENS,
                min_new_tokens=PARITY_MAX_TOKENS,
                do_sample=False,
                pad_token_id=model.config.eos_token_id,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    del model
    return outputs


@pytest.fixture(scope="session")
def make_engine(model_dir):
    """Build an LLMEngine on the test model with overrides; float32 unless told otherwise."""
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.engine.llm_engine import LLMEngine

    def build(**overrides):
        # One thread: a thread pool on a shared 2-core CI box stalls whenever a neighbour runs.
        settings = {"model": str(model_dir), "dtype": "float32", "num_threads": 1}
        if "num_kv_blocks" not in overrides:  # the pool is sized one way or the other, never both
            settings["kv_cache_memory_mb"] = 32
        settings.update(overrides)
        return LLMEngine(EngineConfig(**settings))

    return build
