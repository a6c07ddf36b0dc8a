"""Golden compressed messages: the pipeline's output on the dev sets, for byte-for-byte comparison
of two versions of the code (a rewrite of a pattern that sees client text must not change what is
extracted).

    python -m ctxgate.eval.golden_compress --out before.jsonl --limit 60
    python -m ctxgate.eval.golden_compress --out after.jsonl --limit 60 && cmp before.jsonl after.jsonl

Every question runs in process (no HTTP) through `CompressionPipeline.run`, with client text
neutralised as the gateway does it (messages: special tokens; documents and titles: special tokens
and context markers), under one policy, in several layouts: the passages as `ctxgate.documents`,
and rendered inside the messages the way RAG frameworks do (so message-context detection, its
numbered, tagged, dashed and bare-paragraph layouts, runs on them). One JSON line per question and
layout, keys sorted, so two runs' files compare with `cmp`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctxgate.eval.client import question_messages
from ctxgate.eval.datasets import EvalExample, load_dataset, resolve_dataset_path

DEFAULT_SETS = ("nq-multidoc", "hotpotqa-distractor", "musique")
INSTRUCTIONS = (
    "Answer the question using only the context below. If the context does not say, answer 'unknown'."
)


def _documents_field(example: EvalExample) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    return question_messages(example), example.documents()


def _context_numbered(example: EvalExample) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """LangChain-style: instructions, a "Context:" section of "[n] Title" passages, in the system message."""
    block = "\n\n".join(f"[{i + 1}] {p.title}\n{p.text}" for i, p in enumerate(example.passages))
    return [
        {"role": "system", "content": f"{INSTRUCTIONS}\n\nContext:\n{block}"},
        {"role": "user", "content": example.question},
    ], []


def _tagged(example: EvalExample) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    block = "\n".join(
        f'<document id="p{i}" title="{p.title}">\n{p.text}\n</document>'
        for i, p in enumerate(example.passages)
    )
    return [
        {"role": "system", "content": f"{INSTRUCTIONS}\n\n<documents>\n{block}\n</documents>"},
        {"role": "user", "content": example.question},
    ], []


def _document_title(example: EvalExample) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """ "Document [n](Title: ...)" passages in the user message, closed by a "Question:" line."""
    block = "\n".join(
        f"Document [{i + 1}](Title: {p.title}) {p.text}" for i, p in enumerate(example.passages)
    )
    return [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": f"{block}\n\nQuestion: {example.question}\nAnswer:"},
    ], []


def _dashed_sources(example: EvalExample) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """LlamaIndex-style dashed block of "Source n:" passages."""
    block = "\n\n".join(f"Source {i + 1}: {p.title}\n{p.text}" for i, p in enumerate(example.passages))
    dashes = "-" * 21
    return [
        {
            "role": "user",
            "content": f"Context information is below.\n{dashes}\n{block}\n{dashes}\n"
            f"Given the context information and not prior knowledge, answer the query.\nQuery: {example.question}"
            "\nAnswer: ",
        }
    ], []


def _bare_paragraphs(example: EvalExample) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """LangChain's stuff-documents prompt with a "{title}\\n{page_content}" document prompt."""
    block = "\n\n".join(f"{p.title}\n{p.text}" for p in example.passages)
    return [
        {"role": "system", "content": f"{INSTRUCTIONS}\n\n{block}"},
        {"role": "user", "content": example.question},
    ], []


LAYOUTS: dict[str, Callable[[EvalExample], tuple[list[dict[str, str]], list[dict[str, str]]]]] = {
    "documents": _documents_field,
    "context-numbered": _context_numbered,
    "tagged": _tagged,
    "document-title": _document_title,
    "dashed-sources": _dashed_sources,
    "bare-paragraphs": _bare_paragraphs,
}


class GoldenRunner:
    """One pipeline (tokenizer and embedding model loaded once) for every question."""

    def __init__(self, policy_name: str):
        from ctxgate.backend.model.model_prepare import resolve_model_path
        from ctxgate.backend.model.tokenizer import load_tokenizer
        from ctxgate.compression.pipeline import CompressionPipeline
        from ctxgate.gateway.sanitize import Neutraliser
        from ctxgate.policies.loader import load_policy_file, packaged_policy_dir

        self.tokenizer = load_tokenizer(str(resolve_model_path(None)))
        self.pipeline = CompressionPipeline(self.tokenizer, embed_batch_window_ms=0.0, embed_threads=1)
        self.neutraliser = Neutraliser(self.tokenizer)
        self.policy = load_policy_file(packaged_policy_dir() / f"{policy_name}.yaml")

    def request(self, messages: list[dict[str, str]], documents: list[dict[str, str]]) -> Any:
        """The pipeline's input as the gateway builds it from a request (ctxgate.gateway.prompt_building)."""
        from ctxgate.compression.types import CompressionInput, Document

        neutral = self.neutraliser
        return CompressionInput(
            messages=[{"role": m["role"], "content": neutral.text(m["content"])} for m in messages],
            documents=[
                Document(text=neutral.document(d["text"]), id=d["id"], title=neutral.document(d["title"]))
                for d in documents
            ],
        )

    def compress(self, messages: list[dict[str, str]], documents: list[dict[str, str]]) -> dict[str, Any]:
        result = asyncio.run(self.pipeline.run(self.request(messages, documents), self.policy))
        return {
            "messages": result.messages,
            "prompt_tokens": result.prompt_tokens,
            "original_prompt_tokens": result.original_prompt_tokens,
        }


def write_golden(out: Path, limit: int, policy: str, sets: list[str], layouts: list[str]) -> dict[str, int]:
    runner = GoldenRunner(policy)
    counts: dict[str, int] = {}
    with out.open("w", encoding="utf-8") as handle:
        for name in sets:
            examples = load_dataset(resolve_dataset_path(f"{name}-dev.jsonl"), limit=limit).examples
            for example in examples:
                for layout in layouts:
                    messages, documents = LAYOUTS[layout](example)
                    row = {"set": name, "layout": layout, "id": example.id} | runner.compress(
                        messages, documents
                    )
                    handle.write(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n")
                    counts[f"{name}/{layout}"] = counts.get(f"{name}/{layout}", 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--limit", type=int, default=60, help="first N questions of each set")
    parser.add_argument("--policy", default="rag-default")
    parser.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args(argv)
    counts = write_golden(args.out, args.limit, args.policy, args.sets, args.layouts)
    print(json.dumps({"rows": sum(counts.values()), "per_set_layout": counts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
