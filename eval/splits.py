"""Tune and test halves that share no evidence.

Questions that share a gold passage (same title or same text) are one group, and so are the groups
those join (union-find); each group goes to one half whole, so a test question never shares a gold
passage with a tune question. Groups are shuffled with a fixed seed and the tune half filled first
to half of the questions, so the split is the same on every run and every machine.

Pure Python (no numpy), so the peer scripts' own virtual environments can import it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ctxgate.eval.datasets import EvalExample

SPLITS = ("all", "tune", "test")
SPLIT_SEED = 41


class UnionFind:
    def __init__(self, size: int):
        self.parent = list(range(size))

    def find(self, item: int) -> int:
        while self.parent[item] != item:
            self.parent[item] = self.parent[self.parent[item]]
            item = self.parent[item]
        return item

    def union(self, a: int, b: int) -> None:
        root_a, root_b = self.find(a), self.find(b)
        if root_a != root_b:
            self.parent[max(root_a, root_b)] = min(root_a, root_b)


def evidence_keys(example: EvalExample) -> set[str]:
    """What identifies each gold passage: its title and its text, whitespace- and case-normalised."""
    keys: set[str] = set()
    for passage in example.gold_passages:
        if passage.title.strip():
            keys.add("title:" + " ".join(passage.title.lower().split()))
        keys.add("text:" + " ".join(passage.text.lower().split()))
    return keys


def question_groups(examples: Sequence[EvalExample]) -> list[list[int]]:
    """Indices of the examples, grouped so that no two groups share a gold passage; groups in order
    of their first question."""
    sets = UnionFind(len(examples))
    first_with: dict[str, int] = {}
    for index, example in enumerate(examples):
        for key in evidence_keys(example):
            if key in first_with:
                sets.union(first_with[key], index)
            else:
                first_with[key] = index
    groups: dict[int, list[int]] = {}
    for index in range(len(examples)):
        groups.setdefault(sets.find(index), []).append(index)
    return sorted(groups.values(), key=lambda members: members[0])


def split_indices(examples: Sequence[EvalExample], seed: int = SPLIT_SEED) -> tuple[list[int], list[int]]:
    """(tune, test) example indices, each in file order: whole groups, seeded order, the tune half
    filled to half of the questions (it may pass half by less than one group)."""
    groups = question_groups(examples)
    random.Random(seed).shuffle(groups)
    tune: list[int] = []
    test: list[int] = []
    for members in groups:
        (tune if len(tune) < len(examples) / 2 else test).extend(members)
    return sorted(tune), sorted(test)


def split_examples(examples: Sequence[EvalExample], split: str, seed: int = SPLIT_SEED) -> list[EvalExample]:
    """The tune half, the test half, or all examples (file order kept)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}")
    if split == "all":
        return list(examples)
    tune, test = split_indices(examples, seed)
    return [examples[index] for index in (tune if split == "tune" else test)]


def hop_count(example: EvalExample) -> int:
    """How many passages the answer needs: `meta.hops` where the dataset gives it (MuSiQue), else the
    gold passages (HotpotQA: 2, NQ: 1), at least 1."""
    hops = example.meta.get("hops")
    if isinstance(hops, int) and hops > 0:
        return hops
    return max(1, len(example.gold_passages))
