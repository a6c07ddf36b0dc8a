"""int4 weights (`--weight-quant int4`): the Q4_1 grid of the default model survives, tokens stay right."""

from __future__ import annotations

import pytest
import torch

from ctxgate.backend.engine.config import EngineConfig
from ctxgate.backend.model.linear import INT4_GROUP_SIZE, quantize_int4
from ctxgate.backend.model.model_loader import load_model


def _dequantize(packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int) -> torch.Tensor:
    identity = torch.eye(in_features, dtype=torch.bfloat16)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(identity, packed, INT4_GROUP_SIZE, scales_and_zeros).t()


def test_int4_reproduces_the_shipped_q4_grid(model_dir):
    """The default model was Q4_1 (d * q + m per 32 weights): re-quantizing its weights to int4 with
    min/max groups must give them back up to bfloat16 rounding, not a new 4-bit approximation."""
    model = load_model(model_dir, torch.bfloat16, torch.device("cpu"))
    weight = model.layers[3].gate_up_proj.weight
    restored = _dequantize(*quantize_int4(weight), weight.shape[1])
    mean_relative_error = (restored.float() - weight.float()).abs().mean() / weight.float().abs().mean()
    assert mean_relative_error < 0.01, mean_relative_error  # a fresh 4-bit grid would be ~10x worse

    # The same quantizer on weights that are not on a 4-bit grid loses far more: the check above
    # can tell the two apart.
    random_weight = torch.randn_like(weight.float()).to(torch.bfloat16)
    restored = _dequantize(*quantize_int4(random_weight), weight.shape[1])
    assert (restored.float() - random_weight.float()).abs().mean() / random_weight.float().abs().mean() > 0.03


def test_int4_engine_tokens_match_the_float32_reference(make_engine, parity_prompts, model_dir):
    """Decoding at batch 1 goes through the int4 kernel; each token must be the float32 reference's
    argmax up to bfloat16 noise (teacher-forced, as in test_cpu_kernels)."""
    from transformers import AutoModelForCausalLM

    from ctxgate.backend.engine.api import SamplingParams

    engine = make_engine(dtype="bfloat16", weight_quant="int4")
    assert engine.model.layers[0].qkv_proj.int4_weight is not None
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = [engine.generate([prompt], params)[0] for prompt in parity_prompts]
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    worst_gap = 0.0
    with torch.inference_mode():
        for prompt, generated in zip(parity_prompts, outputs, strict=True):
            logits = reference(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(generated).unsqueeze(1)).squeeze(1)
            worst_gap = max(worst_gap, float((logits.max(dim=1).values - chosen).max()))
    assert worst_gap < 1.0, f"a generated token was {worst_gap:.2f} logits below the reference argmax"


def test_int4_needs_bfloat16():
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(dtype="float32", weight_quant="int4").validate()
    with pytest.raises(ValueError, match="weight_quant"):
        EngineConfig(weight_quant="int3").validate()
