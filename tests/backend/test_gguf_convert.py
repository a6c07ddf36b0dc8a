"""GGUF conversion on small files written here with the `gguf` package's writer, laid out as
llama.cpp's converter lays them out (names, Q/K row permutation for "llama", rope_freqs for Llama 3).

A tiny random model per family goes through `ctxgate model prepare --gguf`'s code path; the
converted directory must hold the weights that were written, and the engine's greedy tokens must
equal Hugging Face's on it. Unsupported files are refused before any tensor is read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ctxgate.backend.engine.api import SamplingParams
from ctxgate.backend.model.gguf_convert import UnsupportedModelError, undo_rope_permutation
from ctxgate.backend.model.rope_fit import fit_llama3_scaling, llama3_factors

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 96
HEAD_DIM = HIDDEN // HEADS


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # The permutation llama.cpp's converter applies to Q/K rows (written out here as the spec).
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.fixture(scope="module")
def smollm_vocab(model_dir) -> dict:
    """The packaged SmolLM2 GGUF's tokenizer fields, to give the tiny models a real tokenizer."""
    from gguf import GGUFReader

    from ctxgate.backend.model.gguf_convert import field_value
    from ctxgate.backend.model.model_prepare import find_packaged_gguf

    reader = GGUFReader(str(find_packaged_gguf()))

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    types = reader.fields["tokenizer.ggml.token_type"]
    return {
        "tokens": strings("tokenizer.ggml.tokens"),
        "merges": strings("tokenizer.ggml.merges"),
        "types": [int(types.parts[i][0]) for i in types.data],
        "bos": int(field_value(reader, "tokenizer.ggml.bos_token_id")),
        "eos": int(field_value(reader, "tokenizer.ggml.eos_token_id")),
        "template": field_value(reader, "tokenizer.chat_template"),
    }


def _hf_weights(vocab: int, qkv_bias: bool, tied: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(vocab, HIDDEN), "model.norm.weight": 1 + w(HIDDEN)}
    if not tied:
        weights["lm_head.weight"] = w(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": w(HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
            p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
            p + "input_layernorm.weight": 1 + w(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
        }
        if qkv_bias:
            weights |= {
                p + "self_attn.q_proj.bias": w(HIDDEN),
                p + "self_attn.k_proj.bias": w(KV_HEADS * HEAD_DIM),
                p + "self_attn.v_proj.bias": w(KV_HEADS * HEAD_DIM),
            }
    return weights


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"


def write_gguf(
    path: Path,
    arch: str,
    vocab: dict,
    weights: dict[str, np.ndarray],
    rope_freqs: np.ndarray | None = None,
    quantize_q8: bool = False,
) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(500000.0 if rope_freqs is not None else 10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_merges(vocab["merges"])
    writer.add_token_types(vocab["types"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    writer.add_chat_template(vocab["template"])
    for name, array in weights.items():
        if arch == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, KV_HEADS)
        if quantize_q8 and array.ndim == 2:
            writer.add_tensor(
                _gguf_name(name),
                quantize(array, GGMLQuantizationType.Q8_0),
                raw_dtype=GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _prepare(tmp_path: Path, monkeypatch, gguf_path: Path) -> Path:
    from ctxgate.backend.model.model_prepare import prepare_gguf

    monkeypatch.setenv("CTXGATE_CACHE_DIR", str(tmp_path / "cache"))
    return prepare_gguf(gguf_path)


def _engine_matches_hf(model_dir: Path, prompts: list[list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.engine.llm_engine import LLMEngine

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
            )
            expected.append(out[0, len(prompt) :].tolist())
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            num_threads=1,
            kv_cache_memory_mb=4,
            max_num_batched_tokens=16,
        )
    )
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, greedy) == expected


@pytest.mark.parametrize(("arch", "qkv_bias", "tied"), [("llama", False, True), ("qwen2", True, False)])
def test_tiny_model_round_trips_and_engine_matches_hf(
    tmp_path, monkeypatch, smollm_vocab, tokenizer, arch, qkv_bias, tied
):
    weights = _hf_weights(len(smollm_vocab["tokens"]), qkv_bias, tied, seed=1)
    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(gguf_path, arch, smollm_vocab, weights)
    model_dir = _prepare(tmp_path, monkeypatch, gguf_path)
    assert model_dir.name == f"tiny-{arch}"  # the served model name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] is tied
    from safetensors.numpy import load_file

    converted = load_file(str(model_dir / "model.safetensors"))
    assert converted.keys() == weights.keys()
    assert all(np.array_equal(converted[name], weights[name]) for name in weights)  # F32: exact
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("def fibonacci(n):\n    ")]
    _engine_matches_hf(model_dir, prompts)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path, monkeypatch, smollm_vocab, tokenizer):
    """Llama 3.1's scaling (factor 8, low 1, high 4, 8192) written as rope_freqs, Q8_0 weights: the
    config gets llama3 rope_scaling, and engine and Hugging Face agree on the scaled positions."""
    factors = llama3_factors(HEAD_DIM, 500000.0, 8.0, 1.0, 4.0, 8192)
    weights = _hf_weights(len(smollm_vocab["tokens"]), qkv_bias=False, tied=False, seed=2)
    gguf_path = tmp_path / "tiny-llama3.gguf"
    write_gguf(gguf_path, "llama", smollm_vocab, weights, rope_freqs=factors, quantize_q8=True)
    model_dir = _prepare(tmp_path, monkeypatch, gguf_path)
    scaling = json.loads((model_dir / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == pytest.approx(8.0)
    refitted = llama3_factors(
        HEAD_DIM,
        500000.0,
        scaling["factor"],
        scaling["low_freq_factor"],
        scaling["high_freq_factor"],
        scaling["original_max_position_embeddings"],
    )
    assert np.allclose(refitted, factors, rtol=1e-5)
    _engine_matches_hf(model_dir, [tokenizer.encode("Once upon a time, there was a little dog who")])


def test_llama31_parameters_fit_exactly():
    factors = llama3_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    fitted = fit_llama3_scaling(factors, 128, 500000.0, 8192)
    assert fitted["factor"] == 8.0
    assert fitted["low_freq_factor"] == pytest.approx(1.0) and fitted["high_freq_factor"] == pytest.approx(
        4.0
    )
    with pytest.raises(UnsupportedModelError, match="llama3"):
        fit_llama3_scaling(factors[::-1].copy(), 128, 500000.0, 8192)


def test_undo_rope_permutation_inverts_llama_cpp_layout():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3 * 64, 10)).astype(np.float32)
    assert np.array_equal(undo_rope_permutation(_llama_cpp_permute(weight, 3), 3), weight)


def _write_header_only(path: Path, arch: str, tensor_type: str = "F32") -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    kind = GGMLQuantizationType[tensor_type]
    block, size = GGML_QUANT_SIZES[kind]
    writer.add_tensor("token_embd.weight", np.zeros((8, 256 // block * size), dtype=np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_is_refused_by_name(tmp_path, monkeypatch):
    gguf_path = tmp_path / "gemma-3-270m.gguf"
    _write_header_only(gguf_path, "gemma3")
    with pytest.raises(UnsupportedModelError, match="'gemma3' is not supported"):
        _prepare(tmp_path, monkeypatch, gguf_path)
    assert not (tmp_path / "cache").exists()  # refused before anything was converted or cached


def test_unsupported_tensor_type_is_refused_by_name(tmp_path, monkeypatch):
    gguf_path = tmp_path / "iq4.gguf"
    _write_header_only(gguf_path, "llama", "IQ4_NL")
    with pytest.raises(UnsupportedModelError, match="IQ4_NL"):
        _prepare(tmp_path, monkeypatch, gguf_path)


def test_cli_refuses_an_unsupported_gguf_with_one_line(tmp_path):
    gguf_path = tmp_path / "gemma-3-270m.gguf"
    _write_header_only(gguf_path, "gemma3")
    for command in (
        ["model", "prepare", "--gguf", str(gguf_path)],
        ["engine", "serve", "--model", str(gguf_path)],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "ctxgate", *command],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "CTXGATE_CACHE_DIR": str(tmp_path)},
        )
        assert result.returncode != 0
        assert "GGUF architecture 'gemma3' is not supported" in result.stderr
        assert "Traceback" not in result.stderr


def test_hf_directory_of_another_architecture_is_refused(tmp_path):
    from ctxgate.backend.model.model_prepare import resolve_model_path

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"]}))
    with pytest.raises(ValueError, match="Gemma3ForCausalLM is not supported"):
        resolve_model_path(str(tmp_path))


def _prepare_cli(gguf_path: Path, cache: Path, *flags: str, stderr_tty: bool = False) -> tuple[str, str]:
    """`ctxgate model prepare --gguf FILE` run for real: (stdout, stderr). With `stderr_tty` its
    stderr is a pseudo-terminal, as in a user's shell."""
    import pty
    import threading

    command = [sys.executable, "-m", "ctxgate", "model", "prepare", "--gguf", str(gguf_path), *flags]
    env = {**os.environ, "CTXGATE_CACHE_DIR": str(cache)}
    if not stderr_tty:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        return result.stdout, result.stderr
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=slave, text=True, env=env)
    os.close(slave)
    stdout, _ = process.communicate(timeout=300)
    reader.join(timeout=10)
    os.close(master)
    assert process.returncode == 0, b"".join(chunks).decode(errors="replace")
    return stdout, b"".join(chunks).decode(errors="replace")


def test_prepare_says_each_step_and_shows_a_bar_on_a_terminal(tmp_path, smollm_vocab):
    weights = _hf_weights(len(smollm_vocab["tokens"]), False, True, seed=3)
    gguf_path = tmp_path / "tiny-steps.gguf"
    write_gguf(gguf_path, "llama", smollm_vocab, weights)
    cache = tmp_path / "cache"

    stdout, stderr = _prepare_cli(gguf_path, cache, stderr_tty=True)
    model_dir = stdout.strip()
    assert Path(model_dir).name == "tiny-steps" and (Path(model_dir) / "model.safetensors").exists()
    for step in (
        f"converting {gguf_path} into {model_dir}",
        f"read tiny-steps.gguf: llama, {LAYERS} layers, {len(weights)} tensors",
        "writing model.safetensors",
        "building the tokenizer",
        "converted in",
    ):
        assert step in stderr, (step, stderr)
    assert "dequantizing weights: 100%" in stderr and f"{len(weights)}/{len(weights)}" in stderr

    # Not a terminal (a log, a pipe): the steps, without a bar; stdout is the folder alone.
    stdout, stderr = _prepare_cli(gguf_path, cache)
    assert stdout == model_dir + "\n"
    assert f"tiny-steps.gguf is converted already: {model_dir}" in stderr
    assert "\r" not in stderr and "dequantizing" not in stderr

    stdout, stderr = _prepare_cli(gguf_path, cache, "--quiet")
    assert stdout == model_dir + "\n" and stderr == ""
