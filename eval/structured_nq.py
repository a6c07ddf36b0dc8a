"""Structured answers through the real OpenAI SDK: `client.beta.chat.completions.parse(...,
response_format=CitedAnswer)` on NQ dev questions with their passages, against a `ctxgate serve`.

    python -m ctxgate.eval.structured_nq --limit 50            # starts `ctxgate serve` on a free port
    python -m ctxgate.eval.structured_nq --url http://host:8000 --limit 50

Prints how many answers parsed into `CitedAnswer`, and how many cite the gold passage.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field

from ctxgate.eval.datasets import resolve_dataset_path

NQ_DEV = "nq-multidoc-dev.jsonl"  # a bare name: found in shared/data/eval beside the checkout
PASSAGES_PER_QUESTION = 4  # the gold passage and the first distractors: prompts stay a few hundred tokens
MAX_TOKENS = 300  # > 200 answer characters (one token each at worst) plus the JSON around them


class CitedAnswer(BaseModel):
    # Bounds the schema carries to the grammar: a 135M model otherwise can run on inside the string,
    # or count 1, 2, 3, ... in the list, until max_tokens cuts the JSON.
    answer: str = Field(max_length=200)
    passage_ids: list[Annotated[int, Field(ge=1, le=PASSAGES_PER_QUESTION)]] = Field(max_length=3)


def questions(path: str | Path = NQ_DEV, limit: int = 50) -> list[dict]:
    with resolve_dataset_path(path).open(encoding="utf-8") as lines:
        return [json.loads(line) for _, line in zip(range(limit), lines, strict=False)]


def messages_for(example: dict) -> tuple[list[dict[str, str]], set[int]]:
    """The chat messages (numbered passages, then the question) and the gold passages' ids."""
    passages = sorted(example["passages"], key=lambda p: not p.get("is_gold"))[:PASSAGES_PER_QUESTION]
    passages = sorted(passages, key=lambda p: p["title"])  # the gold passage is not always first
    numbered = "\n".join(f"[{i}] {p['title']}: {p['text']}" for i, p in enumerate(passages, 1))
    gold = {i for i, p in enumerate(passages, 1) if p.get("is_gold")}
    return [
        {
            "role": "system",
            "content": "Answer from the passages. Reply in JSON with the answer and the ids of "
            "the passages you used.",
        },
        {"role": "user", "content": f"{numbered}\n\nQuestion: {example['question']}"},
    ], gold


def run(base_url: str, model: str, limit: int, data: str | Path = NQ_DEV) -> dict[str, float]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    parsed = cited_gold = 0
    failed: list[str] = []
    started = time.perf_counter()
    examples = questions(data, limit=limit)
    for example in examples:
        messages, gold = messages_for(example)
        try:
            completion = client.beta.chat.completions.parse(
                model=model,
                messages=messages,
                response_format=CitedAnswer,
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
        except (openai.LengthFinishReasonError, ValueError) as exc:  # cut by max_tokens, or not parseable
            failed.append(f"{example['id']}: {type(exc).__name__}")
            continue
        answer = completion.choices[0].message.parsed
        if isinstance(answer, CitedAnswer):
            parsed += 1
            cited_gold += bool(gold & set(answer.passage_ids))
        else:
            failed.append(f"{example['id']}: not parsed")
    return {
        "questions": len(examples),
        "parsed": parsed,
        "cited_gold": cited_gold,
        "failed": failed,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running gateway (default: start `ctxgate serve` on a free port)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument(
        "--input",
        default=NQ_DEV,
        help="NQ multi-document JSONL: a path, or a file name in "
        "shared/data/eval beside the checkout (default: %(default)s)",
    )
    args = parser.parse_args()
    if args.url:
        print(json.dumps(run(args.url.rstrip("/") + "/v1", args.model, args.limit, args.input)))
        return
    from ctxgate.eval.server import GatewayProcess

    with GatewayProcess() as url:
        print(json.dumps(run(url + "/v1", args.model, args.limit, args.input)))


if __name__ == "__main__":
    main()
