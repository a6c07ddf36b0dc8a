"""Evidence retention and cost of the compressor on the eval datasets.

    python -m compression.retention --data ../shared/data/eval/nq-multidoc-dev.jsonl --ratios 0.25,0.10
    python -m compression.retention --data ../shared/data/eval/nq-multidoc-dev.jsonl --cost 12

Retention: for each question the passages block is capped at `ratio` of its uncompressed tokens
(backend tokenizer), and we report the share of questions whose sent context still holds a gold
answer string (lower-cased, whitespace-normalized; yes/no answers excluded), with the achieved
ratio and compression time. Ratios run in one process, so the first is cold (embeddings computed)
and later ones reuse the embedding cache.

Cost (`--cost N`): for N questions not seen before in the run (cold caches), the compression time
versus the prefill time it saves, both measured here: the in-process engine prefills the full and
the compressed prompt (max_tokens=1) and reports `prefill_ms` for each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

YES_NO = {"yes", "no"}


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def load_rows(path: str, limit: int, skip: int = 0) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [row for row in rows if not (YES_NO & {normalize(a) for a in row["answers"]})]
    return rows[skip : skip + limit]


def make_policy(budget: int, args: argparse.Namespace):
    from policies.schema import Policy

    return Policy(
        name="retention",
        max_input_tokens=max(budget + 256, 512),
        documents={"max_tokens": budget},
        rerank={"top_k": args.top_k, "method": args.method},
        extraction={"neighbours": args.neighbours, "expand_query": args.expand_query},
    )


def request_for(row: dict[str, Any]):
    from compression.types import CompressionInput, Document

    documents = [Document(text=p["text"], title=p.get("title")) for p in row["passages"]]
    return CompressionInput(messages=[{"role": "user", "content": row["question"]}], documents=documents)


def full_block_tokens(tokenizer, request) -> int:
    from compression.assembly import render_context
    from compression.state import Passage

    return tokenizer.count(
        render_context([Passage(document=d, position=i) for i, d in enumerate(request.documents)])
    )


async def retention(pipeline, tokenizer, rows, ratio: float, args: argparse.Namespace) -> dict[str, Any]:
    kept, ratios, timings = 0, [], []
    for row in rows:
        request = request_for(row)
        full_tokens = full_block_tokens(tokenizer, request)
        started = time.perf_counter()
        result = await pipeline.run(request, make_policy(max(16, int(full_tokens * ratio)), args))
        timings.append((time.perf_counter() - started) * 1000)
        context = normalize(result.context_text)
        ratios.append(tokenizer.count(result.context_text) / full_tokens)
        kept += any(normalize(answer) in context for answer in row["answers"])
    timings.sort()
    return {
        "ratio_cap": ratio,
        "questions": len(rows),
        "answer_retention": round(kept / len(rows), 3),
        "mean_context_ratio": round(statistics.mean(ratios), 3),
        "compression_ms_p50": round(timings[len(timings) // 2], 1),
        "compression_ms_p95": round(timings[max(0, int(len(timings) * 0.95) - 1)], 1),
    }


async def cost(pipeline, tokenizer, rows, ratio: float, args: argparse.Namespace) -> dict[str, Any]:
    from backend.api import GenerationRequest, SamplingParams
    from backend.async_engine import AsyncEngine
    from backend.config import EngineConfig

    engine = AsyncEngine(
        EngineConfig(model=str(tokenizer.model_dir), max_model_len=4096, enable_prefix_caching=False)
    )

    async def prefill_ms(messages) -> float:
        request = GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=tokenizer.encode_chat(messages),
            sampling=SamplingParams(max_tokens=1, temperature=0),
        )
        final = [delta async for delta in engine.generate(request)][-1]
        return final.metrics.prefill_ms

    try:
        await prefill_ms([{"role": "user", "content": "warm up"}])
        samples = []
        for row in rows:
            request = request_for(row)
            full_tokens = full_block_tokens(tokenizer, request)
            started = time.perf_counter()
            result = await pipeline.run(request, make_policy(max(16, int(full_tokens * ratio)), args))
            compression_ms = (time.perf_counter() - started) * 1000

            original = [{"role": "user", "content": original_content(request)}]
            # Interleave full / compressed so a busy neighbour hurts both alike.
            full_ms = await prefill_ms(original)
            compressed_ms = await prefill_ms(result.messages)
            samples.append(
                (compression_ms, full_ms - compressed_ms, result.original_prompt_tokens, result.prompt_tokens)
            )
    finally:
        engine.shutdown()
    fractions = sorted(c / max(saved, 1e-9) for c, saved, _, _ in samples)
    return {
        "ratio_cap": ratio,
        "questions": len(samples),
        "mean_compression_ms_cold": round(statistics.mean(s[0] for s in samples), 1),
        "mean_prefill_saved_ms": round(statistics.mean(s[1] for s in samples), 1),
        "compression_over_saved_median": round(fractions[len(fractions) // 2], 3),
        "compression_over_saved_mean": round(
            statistics.mean(s[0] for s in samples) / max(statistics.mean(s[1] for s in samples), 1e-9), 3
        ),
        "mean_prompt_tokens": [
            round(statistics.mean(s[2] for s in samples)),
            round(statistics.mean(s[3] for s in samples)),
        ],
    }


def original_content(request) -> str:
    from compression.assembly import CONTEXT_HEADER, QUESTION_HEADER, render_context
    from compression.state import Passage

    context = render_context([Passage(document=d, position=i) for i, d in enumerate(request.documents)])
    return f"{CONTEXT_HEADER}\n{context}\n\n{QUESTION_HEADER} {request.messages[-1]['content']}"


async def main_async(args: argparse.Namespace) -> None:
    from backend.model_prepare import prepare_default_model
    from backend.tokenizer import load_tokenizer
    from compression.pipeline import CompressionPipeline

    tokenizer = load_tokenizer(str(args.model_dir or prepare_default_model()))
    pipeline = CompressionPipeline(tokenizer)
    common = {
        "data": Path(args.data).name,
        "top_k": args.top_k,
        "method": args.method,
        "expand_query": args.expand_query,
    }
    if args.limit:
        rows = load_rows(args.data, args.limit)
        for ratio in [float(r) for r in args.ratios.split(",")]:
            print(json.dumps(common | await retention(pipeline, tokenizer, rows, ratio, args)), flush=True)
        # Warm-cache latency: the same requests again (embeddings cached).
        warm = await retention(pipeline, tokenizer, rows[:20], float(args.ratios.split(",")[0]), args)
        print(json.dumps(common | {"warm_20_passage_requests": warm}), flush=True)
    if args.cost:
        rows = load_rows(args.data, args.cost, skip=args.limit)
        ratio = float(args.ratios.split(",")[0])
        print(json.dumps(common | {"cost": await cost(pipeline, tokenizer, rows, ratio, args)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/eval/nq-multidoc-dev.jsonl")
    parser.add_argument("--ratios", default="0.25", help="comma-separated caps, e.g. 0.25,0.10")
    parser.add_argument("--limit", type=int, default=100, help="questions for the retention check (0: skip)")
    parser.add_argument("--cost", type=int, default=0, help="questions for the cost check (0: skip)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--method", default="embedding-bm25")
    parser.add_argument("--neighbours", type=int, default=0)
    parser.add_argument("--expand-query", action="store_true", help="multi-hop query expansion")
    parser.add_argument("--model-dir", default=None)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
