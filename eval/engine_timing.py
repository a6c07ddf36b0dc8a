"""Quick engine timing without HTTP: decode time per token at batch 1 and decode throughput at batch N.

    python -m eval.engine_timing --dtype bfloat16 --threads 2 --batch 16

The proper workloads (W1-W3, HF baseline, P50/P95/P99) are `ctxgate bench engine`; this is the
inner-loop check used while tuning the engine itself.
"""

from __future__ import annotations

import argparse
import statistics
import time


def measure(
    dtype: str, threads: int, batch: int, prompt_tokens: int, output_tokens: int, backend: str,
    weight_quant: str = "none",
) -> dict:
    from backend.api import GenerationRequest, SamplingParams
    from backend.config import EngineConfig
    from backend.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(dtype=dtype, num_threads=threads, attention_backend=backend, weight_quant=weight_quant)
    )
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    for index in range(batch):
        # Distinct prompts so the prefix cache does not share anything.
        prompt = [100 + (index * 7919 + position * 31) % 40000 for position in range(prompt_tokens)]
        engine.add_request(GenerationRequest(f"timing-{index}", prompt, params))
    started = time.perf_counter()
    decode_step_seconds: list[float] = []
    decode_tokens = 0
    while engine.has_unfinished_requests():
        step_started = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - step_started
        if engine.stats().last_step_num_tokens == engine.stats().last_step_batch_size:  # pure decode step
            decode_step_seconds.append(elapsed)
            decode_tokens += len(deltas)
    total = time.perf_counter() - started
    decode_seconds = sum(decode_step_seconds)
    return {
        "dtype": str(engine.dtype),
        "threads": threads,
        "batch": batch,
        "decode_step_ms_p50": statistics.median(decode_step_seconds) * 1000.0,
        "decode_tok_per_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
        "output_tok_per_s_overall": batch * output_tokens / total,
        "total_s": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--weight-quant", choices=["none", "int4"], default="none")
    args = parser.parse_args()
    import os

    result = measure(
        args.dtype, args.threads or os.cpu_count() or 1, args.batch, args.prompt_tokens, args.output_tokens,
        args.attention_backend, args.weight_quant,
    )
    print(" ".join(f"{key}={value:.2f}" if isinstance(value, float) else f"{key}={value}" for key, value in result.items()))


if __name__ == "__main__":
    main()
