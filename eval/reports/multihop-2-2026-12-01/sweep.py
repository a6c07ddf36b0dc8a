"""Issue 16 diagnostics + sweep: rag-default on the retention harness's halves, per budget, with a
per-lost-question account of where the answer went. Embeddings cached on disk between runs
(text-keyed, so results are identical to first-sight runs; the times here are not first-sight)."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from collections import Counter
from pathlib import Path

from compression import stages as S
from eval.datasets import load_dataset, resolve_dataset_path
from eval.metrics import answer_in_text
from eval.retention import RetentionHarness, policy_with_overrides, split_examples, summarize
from policies.loader import load_policy_file, packaged_policy_dir

CACHE = Path(os.environ.get("EMB_CACHE", "/tmp/emb-cache.pkl"))
SNAP: dict = {}


class Spy(S.Stage):
    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name

    def enabled(self, state, policy):
        return self.inner.enabled(state, policy)

    async def run(self, state, ctx):
        report = await self.inner.run(state, ctx)
        if self.name == "rerank":
            SNAP["rerank_kept"] = [p.position for p in state.passages]
            SNAP["rerank_scores"] = {p.position: p.score for p in state.passages}
        if self.name == "extraction":
            SNAP["extracted"] = {
                p.position: (list(p.kept_sentences) if p.kept_sentences is not None else None) for p in state.passages
            }
            SNAP["sentences"] = {p.position: p.sentences for p in state.passages}
            SNAP["scores"] = {p.position: p.sentence_scores for p in state.passages}
            SNAP["embedded"] = {p.position: p.embed_sentences for p in state.passages}
        return report


def diagnose(example, result_ok, details):
    """Where the answer was lost."""
    answer_positions = [
        i for i, p in enumerate(example.passages) if answer_in_text(p.text, example.answers)
    ]
    gold = [i for i, p in enumerate(example.passages) if p.is_gold]
    info = {
        "q": example.question,
        "a": example.answers[0],
        "type": example.meta.get("type"),
        "gold": [example.passages[i].title for i in gold],
        "answer_passages": [example.passages[i].title for i in answer_positions],
        "trigger": details.get("extraction.second_hop"),
        "cues": details.get("extraction.cues"),
        "bridges": details.get("extraction.bridges"),
        "bridges_kept_rerank": details.get("rerank.bridges_kept"),
        "rerank_kept": [example.passages[i].title for i in SNAP.get("rerank_kept", [])],
    }
    if not answer_positions:
        info["stage"] = "answer-not-in-passages"
        return info
    rk = set(SNAP.get("rerank_kept", range(len(example.passages))))
    survivors = [i for i in answer_positions if i in rk]
    if not survivors:
        info["stage"] = "rerank-cut"
        return info
    # extraction: which answer sentences existed, were embedded, their score rank
    all_scores = []
    for pos, scores in (SNAP.get("scores") or {}).items():
        for si, sc in enumerate(scores or []):
            all_scores.append((sc, pos, si))
    all_scores.sort(reverse=True)
    rank_of = {(pos, si): r for r, (_, pos, si) in enumerate(all_scores)}
    answer_sents = []
    for pos in survivors:
        sentences = SNAP["sentences"].get(pos) or []
        for si, s in enumerate(sentences):
            if answer_in_text(s, example.answers):
                emb = SNAP["embedded"].get(pos)
                answer_sents.append(
                    {
                        "title": example.passages[pos].title,
                        "si": si,
                        "embedded": emb is None or si in emb,
                        "rank": rank_of.get((pos, si)),
                        "kept": si in (SNAP["extracted"].get(pos) or []),
                        "text": s[:160],
                    }
                )
    info["answer_sentences"] = answer_sents
    info["n_units"] = len(all_scores)
    kept_any = any(a["kept"] for a in answer_sents)
    info["stage"] = "after-extraction(fit)" if kept_any else "extraction"
    return info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", action="append", required=True)
    ap.add_argument("--split", default="all")
    ap.add_argument("--budgets", default="560,200")
    ap.add_argument("--policy", default="rag-default")
    ap.add_argument("--override", action="append", default=[])
    ap.add_argument("--limit", type=int)
    ap.add_argument("--out", required=True)
    ap.add_argument("--diag", action="store_true")
    args = ap.parse_args()
    harness = RetentionHarness(first_sight=False)
    harness.pipeline.stages = tuple(Spy(s) for s in harness.pipeline.stages)
    embedder = harness.pipeline.services.embedder
    if CACHE.exists():
        embedder._local.update(pickle.loads(CACHE.read_bytes()))
    base = load_policy_file(packaged_policy_dir() / f"{args.policy}.yaml")
    extra = {}
    for pair in args.override:
        k, _, v = pair.partition("=")
        import yaml

        extra[k] = yaml.safe_load(v)
    report = {}
    for name in args.input:
        dataset = load_dataset(resolve_dataset_path(name))
        for split in args.split.split(","):
            examples = split_examples(dataset.examples, split)
            examples = [e for e in examples if not e.is_yes_no][: args.limit]
            for budget in [int(b) for b in args.budgets.split(",")]:
                policy = policy_with_overrides(base, {"documents.max_tokens": budget, **extra})
                results, lost = [], []
                for example in examples:
                    SNAP.clear()
                    r = harness.run_one(example, policy)
                    results.append(r)
                    if args.diag and not r.answer_retained:
                        lost.append(diagnose(example, r.answer_retained, r.details) | {"id": example.id})
                    fired = r.details.get("extraction.second_hop")
                    r.details["_fired"] = fired
                s = summarize(results)
                s["fired"] = sum(1 for r in results if r.details.get("_fired"))
                key = f"{dataset.name}|{split}|{budget}"
                report[key] = {"summary": s, "lost": lost, "retained": {r.id: r.answer_retained for r in results}, "tokens": {r.id: [r.original_tokens, r.sent_tokens] for r in results}}
                print(key, json.dumps({k: s[k] for k in ("n_scored", "answer_retention", "compression_ratio", "fired")}), flush=True)
                if args.diag:
                    print("  stages:", Counter(x["stage"] for x in lost), flush=True)
                Path(args.out).write_text(json.dumps(report, indent=1, default=list))
    Path(args.out).write_text(json.dumps(report, indent=1, default=list))
    tmp = CACHE.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(dict(embedder._local)))
    os.replace(tmp, CACHE)


if __name__ == "__main__":
    sys.exit(main())
