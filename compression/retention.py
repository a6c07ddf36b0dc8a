"""Evidence-retention check: is a gold answer string still in the compressed context?

    python -m compression.retention --data ../shared/data/eval/nq-multidoc-dev.jsonl --ratio 0.25

For each question the documents block is capped at `ratio` of its uncompressed tokens (the backend
tokenizer), the pipeline runs with the given policy knobs, and the share of questions whose sent
context still contains any gold answer (lower-cased, whitespace-normalized) is reported, with the
mean achieved ratio and the compression time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

YES_NO = {"yes", "no"}


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


async def evaluate(args: argparse.Namespace) -> dict:
    from backend.model_prepare import prepare_default_model
    from backend.tokenizer import load_tokenizer
    from compression.assembly import render_context
    from compression.pipeline import CompressionPipeline
    from compression.state import Passage
    from compression.types import CompressionInput, Document
    from policies.schema import Policy

    tokenizer = load_tokenizer(str(args.model_dir or prepare_default_model()))
    pipeline = CompressionPipeline(tokenizer)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    rows = [row for row in rows if not (YES_NO & {normalize(a) for a in row["answers"]})][: args.limit]
    kept, ratios, timings, gold_kept = 0, [], [], 0
    for row in rows:
        documents = [Document(text=p["text"], title=p.get("title")) for p in row["passages"]]
        full_block = render_context([Passage(document=d, position=i) for i, d in enumerate(documents)])
        full_tokens = tokenizer.count(full_block)
        budget = max(16, int(full_tokens * args.ratio))
        policy = Policy(
            name="retention",
            max_input_tokens=max(budget + 256, 512),
            documents={"max_tokens": budget},
            rerank={"top_k": args.top_k, "method": args.method},
            extraction={"neighbours": args.neighbours},
            assembly={"order": "best-first"},
        )
        request = CompressionInput(messages=[{"role": "user", "content": row["question"]}], documents=documents)
        if args.warm:
            await pipeline.run(request, policy)
        started = time.perf_counter()
        result = await pipeline.run(request, policy)
        timings.append((time.perf_counter() - started) * 1000)
        context = normalize(result.context_text)
        ratios.append(tokenizer.count(result.context_text) / full_tokens)
        if any(normalize(answer) in context for answer in row["answers"]):
            kept += 1
        gold_texts = [normalize(p["text"])[:60] for p in row["passages"] if p.get("is_gold")]
        if any(g[:40] in context for g in gold_texts):
            gold_kept += 1
    timings.sort()
    return {
        "data": Path(args.data).name,
        "questions": len(rows),
        "ratio_cap": args.ratio,
        "answer_retention": round(kept / len(rows), 3),
        "mean_context_ratio": round(statistics.mean(ratios), 3),
        "compression_ms_p50": round(timings[len(timings) // 2], 1),
        "compression_ms_p95": round(timings[int(len(timings) * 0.95) - 1], 1),
        "top_k": args.top_k,
        "method": args.method,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/eval/nq-multidoc-dev.jsonl")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--method", default="embedding-bm25")
    parser.add_argument("--neighbours", type=int, default=0)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--warm", action="store_true", help="run each request twice, time the second")
    print(json.dumps(asyncio.run(evaluate(parser.parse_args()))))


if __name__ == "__main__":
    main()
