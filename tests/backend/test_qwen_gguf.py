"""A second real model: Qwen2.5-Coder-0.5B-Instruct from its Q4_K_M GGUF (Q5_0/Q4_K/Q6_K/Q8_0 tensors).

Qwen2 differs from SmolLM2 where a Llama-only engine would break: Q/K/V biases, an untied LM head,
7 query heads per KV head, no rotary permutation in the GGUF, a 151,936-token vocabulary. The
engine's greedy tokens must equal float32 Hugging Face `generate` on the same dequantised weights,
alone and under continuous batching with prefix caching, chunked prefill and preemption; the
bfloat16 kernel path is judged against the float32 logits on this CPU's path and on AVX2.
Prompts are short and continuations few: the model is ~4x SmolLM2's size per token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ctxgate.backend.engine.api import SamplingParams
from ctxgate.backend.platform.cpu_features import ISA_CAP_ENV, TORCH_ISA_CAPS, cpu_path, runnable_kernel_isas

pytestmark = pytest.mark.large_model

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# Shared by two prompts, long enough (> 2 blocks) for prefix-cache hits.
SHARED = (
    "You are a careful Python reviewer. Read the function below, say what it does in one "
    "sentence, then name one bug it has and how to fix it.\n\n"
)
TEXTS = [
    "def add(a, b):",
    "The capital of France is",
    SHARED + "def mean(xs):\n    return sum(xs) / len(xs)\n",
    SHARED + "def last(xs):\n    return xs[len(xs)]\n",
]


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_dir):
    from ctxgate.backend.model.tokenizer import load_tokenizer

    return load_tokenizer(str(qwen_dir))


@pytest.fixture(scope="module")
def prompts(qwen_tokenizer) -> list[list[int]]:
    chat = qwen_tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])
    return [qwen_tokenizer.encode(text) for text in TEXTS] + [chat]


@pytest.fixture(scope="module")
def hf_model(qwen_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(qwen_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts) -> list[list[int]]:
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            generated = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=hf_model.config.pad_token_id,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def make_qwen(qwen_dir):
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.engine.llm_engine import LLMEngine

    def build(**overrides):
        settings = {"model": str(qwen_dir), "dtype": "float32", "num_threads": 1}
        if "num_kv_blocks" not in overrides:
            settings["kv_cache_memory_mb"] = 16
        return LLMEngine(EngineConfig(**{**settings, **overrides}))

    return build


def test_the_gguf_converts_to_qwen2_with_biases_and_an_untied_head(qwen_dir, qwen_tokenizer):
    config = json.loads((qwen_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (14, 2, 64)
    assert (config["hidden_size"], config["vocab_size"], config["rope_theta"]) == (896, 151936, 1e6)
    assert config["tie_word_embeddings"] is False
    from safetensors import safe_open

    with safe_open(str(qwen_dir / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"lm_head.weight", "model.layers.0.self_attn.q_proj.bias"} <= names
    # The tokenizer and chat template carried over from the GGUF metadata.
    rendered = qwen_tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert qwen_tokenizer.eos_token_ids == {151645}  # <|im_end|>


def test_each_prompt_alone_matches_hf(make_qwen, prompts, hf_greedy):
    engine = make_qwen()
    for prompt, expected in zip(prompts, hf_greedy, strict=True):
        assert engine.generate([prompt], GREEDY) == [expected]


def test_one_batch_with_prefix_cache_hits_matches_hf(make_qwen, prompts, hf_greedy):
    engine = make_qwen()
    assert engine.generate([prompts[2]], GREEDY) == [hf_greedy[2]]  # fills the cache with SHARED
    assert engine.generate(prompts, GREEDY) == hf_greedy
    assert engine.stats().prefix_cache_hit_tokens >= 32
    assert engine.stats().num_kv_blocks_free == engine.stats().num_kv_blocks_total


def test_chunked_prefill_and_preemption_match_hf(make_qwen, prompts, hf_greedy):
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    engine = make_qwen(num_kv_blocks=-(-longest // 16) + 2, max_num_batched_tokens=16)
    assert engine.generate(prompts, GREEDY) == hf_greedy
    assert engine.stats().num_preemptions > 0
    assert engine.stats().last_step_num_tokens <= 16


def test_bfloat16_kernel_path_stays_on_the_float32_argmax(make_qwen, prompts, hf_model):
    """bfloat16 with the C++ kernels on (GEMV plus bias, fused layers, paged decode attention with
    7 query heads per KV head, traced decode steps), 16-token chunks and a pool that preempts.

    Two bfloat16 roundings can flip a near-tie, so each token is judged teacher-forced against the
    float32 logits: within 1 logit of the argmax (see test_cpu_kernels' SmolLM2 twin)."""
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    engine = make_qwen(dtype="bfloat16", num_kv_blocks=-(-longest // 16) + 2, max_num_batched_tokens=16)
    path = cpu_path()
    if path.auto_dtype == "bfloat16":
        qkv = engine.model.layers[0].qkv_proj
        assert qkv.bias is not None and qkv.gemv_max_rows >= 1 and engine.model.use_fused_layers
        assert engine.runner.decode_graphs is not None  # Qwen's biases no longer rule tracing out
    outputs = engine.generate(prompts, GREEDY)
    assert engine.stats().num_preemptions > 0
    worst_gap = 0.0
    with torch.inference_mode():
        for prompt, generated in zip(prompts, outputs, strict=True):
            logits = hf_model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(generated).unsqueeze(1)).squeeze(1)
            worst_gap = max(worst_gap, float((logits.max(dim=1).values - chosen).max()))
    assert worst_gap < 1.0, f"a generated token was {worst_gap:.2f} logits below the reference argmax"


def test_bfloat16_kernel_path_on_avx2(qwen_dir):
    """The same check in a child process with the CPU capped to AVX2 (our kernels and torch's)."""
    isa = "avx2"
    if isa not in runnable_kernel_isas():  # pragma: no cover - every x86-64 CPU since 2013
        pytest.skip("this CPU cannot run the avx2 path")
    if cpu_path().kernel_isa == isa:
        pytest.skip("avx2 is this machine's own path, tested in this process")
    env = {**os.environ, ISA_CAP_ENV: isa, **TORCH_ISA_CAPS[isa]}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_bfloat16_kernel_path_stays_on_the_float32_argmax",
        ],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout, result.stdout[-2000:]
