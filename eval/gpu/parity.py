"""Correctness at one shape: the engine's greedy tokens against transformers' on the same weights.

Three prompts x 32 tokens, greedy, ignore_eos, in one engine batch; the first step's logits of both
compared (max |diff|). Where tokens differ, the first divergence is accepted when transformers' own
top-2 logits there are within `TIE` (a near tie that bfloat16 rounding may break either way).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

PROMPTS = (
    "The capital of France is Paris. The capital of Germany is",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List three reasons why the sky looks blue during the day and red at sunset.",
)
MAX_TOKENS = 32
TIE = 0.05


@dataclass
class PromptParity:
    equal: bool
    first_divergence: int | None
    top2_gap_at_divergence: float | None


@dataclass
class ParityResult:
    device: str
    dtype: str
    cuda_graphs: bool
    passed: bool
    max_abs_logit_diff_step1: float
    logit_std_step1: float
    prompts: list[PromptParity]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _engine_run(model_dir: Path, device: str, dtype: str, cuda_graphs: bool, prompts: list[list[int]]):
    """Greedy tokens of each prompt and the first (prefill) step's logits, from the engine."""
    from ctxgate.backend.engine.api import SamplingParams
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device=device,
            dtype=dtype,
            kv_cache_memory_mb=256,
            max_model_len=512,
            cuda_graphs=cuda_graphs if device != "cpu" else None,
        )
    )
    # The first step prefills all three prompts at once; its logits are what the sampler saw.
    execute = engine.runner.execute
    first: list[torch.Tensor] = []

    def recording(scheduled, eager=False):
        output = execute(scheduled, eager)
        if not first:
            first.append(output.logits.float().cpu())
        return output

    engine.runner.execute = recording
    try:
        tokens = engine.generate(
            prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        )
    finally:
        engine.runner.execute = execute
    del engine
    return tokens, first[0]


def _hf_run(model_dir: Path, device: str, dtype: torch.dtype, prompts: list[list[int]]):
    """transformers' greedy tokens (one prompt at a time: no padding) and its first-step logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    tokens, first_logits, steps_logits = [], [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=2,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logits = [step[0].float().cpu() for step in out.logits]
            first_logits.append(logits[0])
            steps_logits.append(logits)
    del model
    return tokens, torch.stack(first_logits), steps_logits


def _compare(engine_tokens: list[int], hf_tokens: list[int], hf_logits: list[torch.Tensor]) -> PromptParity:
    for step, (mine, theirs) in enumerate(zip(engine_tokens, hf_tokens, strict=True)):
        if mine != theirs:
            top2 = hf_logits[step].topk(2).values
            return PromptParity(False, step, float(top2[0] - top2[1]))
    return PromptParity(True, None, None)


def check_parity(
    model_dir: str | Path, device: str, dtype: str = "bfloat16", cuda_graphs: bool = False
) -> ParityResult:
    from ctxgate.backend.model.tokenizer import Tokenizer

    model_dir = Path(model_dir)
    tokenizer = Tokenizer(model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    engine_tokens, engine_first = _engine_run(model_dir, device, dtype, cuda_graphs, prompts)
    hf_tokens, hf_first, hf_steps = _hf_run(model_dir, device, getattr(torch, dtype), prompts)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    per_prompt = [_compare(e, h, s) for e, h, s in zip(engine_tokens, hf_tokens, hf_steps, strict=True)]
    passed = all(p.equal or (p.top2_gap_at_divergence or 0.0) <= TIE for p in per_prompt)
    diff = float((engine_first - hf_first).abs().max())
    return ParityResult(device, dtype, cuda_graphs, passed, diff, float(hf_first.std()), per_prompt)
