"""`ctxgate bench engine --guided-arm`: decode throughput with a JSON-schema grammar mask on every row
of a batch, against the same batch unconstrained, rounds interleaved in one run; and the mask's own
cost per token (fill every row's bitmask, apply it to the logits)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ctxgate.backend.engine.api import GenerationRequest, SamplingParams
from ctxgate.backend.engine.guided import GuideSpec, compiler_for
from ctxgate.backend.engine.llm_engine import LLMEngine
from ctxgate.backend.engine.sampler import apply_guides
from ctxgate.backend.engine.sequence import Sequence

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "answer": {"type": "string"},
            "passage_ids": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["answer", "passage_ids"],
        "additionalProperties": False,
    },
}
PROMPT = "List facts about rivers as JSON objects with an answer and the passage ids."


def _decode_rate(
    engine: LLMEngine, prompt: list[int], sampling: SamplingParams, batch: int, tag: str
) -> float:
    """Output tokens per second over the decode-only steps of one batch."""
    for row in range(batch):
        engine.add_request(GenerationRequest(f"{tag}-{row}", prompt, sampling))
    tokens, seconds = 0, 0.0
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - started
        if engine.last_step_num_tokens == engine.last_step_batch_size:  # a decode-only step
            tokens += len(deltas)
            seconds += elapsed
    return tokens / seconds if seconds else 0.0


def _mask_cost_s(engine: LLMEngine, guide: Any, batch: int, repeats: int = 50) -> float:
    """Seconds per token of the mask (fill + apply) with `batch` guided rows."""
    sequences = [Sequence(f"m{row}", [1], SamplingParams(guide=guide), 8, row) for row in range(batch)]
    for seq in sequences:
        seq.matcher = guide.matcher()
    logits = torch.zeros(batch, engine.vocab_size)
    started = time.perf_counter()
    for _ in range(repeats):
        apply_guides(logits, sequences)
    return (time.perf_counter() - started) / (repeats * batch)


def guided_arm(
    engine: LLMEngine, batch: int = 16, output_tokens: int = 32, rounds: int = 3
) -> dict[str, Any]:
    guide = compiler_for(engine.tokenizer).compile_now(GuideSpec.json_schema(SCHEMA, "bench"))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    # Same length both ways: the grammar cannot end early (its array goes on) and EOS is ignored.
    plain = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    guided = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True, guide=guide)
    unconstrained, constrained = [], []
    for round_index in range(rounds):  # interleaved: the machine's noise falls on both arms alike
        unconstrained.append(_decode_rate(engine, prompt, plain, batch, f"plain{round_index}"))
        constrained.append(_decode_rate(engine, prompt, guided, batch, f"guided{round_index}"))
    plain_rate, guided_rate = statistics.median(unconstrained), statistics.median(constrained)
    return {
        "batch": batch,
        "output_tokens": output_tokens,
        "rounds": rounds,
        "unconstrained_tokens_per_s": round(plain_rate, 1),
        "json_schema_tokens_per_s": round(guided_rate, 1),
        "throughput_ratio": round(guided_rate / plain_rate, 3) if plain_rate else None,
        "mask_us_per_token": round(_mask_cost_s(engine, guide, batch) * 1e6, 1),
    }
