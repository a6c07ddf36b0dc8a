"""`ctxgate bench multiturn`'s workload and report: conversations built from a dev set carry the
previous turn's passages again, both arms run the same budget, and the report adds up per turn."""

from __future__ import annotations

from ctxgate.eval.bench_multiturn import (
    ArmTurn,
    arm_policies,
    build_conversations,
    render_markdown,
    summarise,
    totals,
)
from ctxgate.eval.datasets import load_dataset, resolve_dataset_path
from ctxgate.policies.schema import Policy


def test_conversations_retrieve_the_previous_turns_passages_again():
    examples = load_dataset(resolve_dataset_path("nq-multidoc-dev.jsonl"), limit=8).examples
    conversations = build_conversations(examples, conversations=2, turns=4)
    assert [len(c) for c in conversations] == [4, 4]
    assert conversations[0][0].question == examples[0].question
    assert conversations[1][0].question == examples[4].question
    for conversation, first in zip(conversations, (0, 4), strict=True):
        for t in range(1, 4):
            gold_before = next(p for p in examples[first + t - 1].passages if p.is_gold)
            assert gold_before.text in [d["text"] for d in conversation[t].documents]
            gold_now = next(p for p in examples[first + t].passages if p.is_gold)
            assert gold_now.text in [d["text"] for d in conversation[t].documents]


def test_the_arms_differ_only_in_conversation_memory():
    arms = arm_policies("rag-default", 3072)
    today, memory = (Policy.model_validate(arms[arm]) for arm in ("today", "memory"))
    assert not today.conversation.enabled and memory.conversation.enabled
    assert today.max_input_tokens == memory.max_input_tokens == 3072
    assert today.model_dump(exclude={"name", "conversation"}) == memory.model_dump(
        exclude={"name", "conversation"}
    )


def test_report_per_turn_and_totals():
    rows = {
        "today": [
            ArmTurn([100.0, 300.0], [900, 1100], 16, 1000, [True, False]),
            ArmTurn([200.0, 400.0], [1500, 1500], 32, 1500, [True]),
        ],
        "memory": [
            ArmTurn([100.0, 300.0], [900, 1100], 16, 1000, [True, True]),
            ArmTurn([150.0], [1800], 1024, 1800, [True], 7),
        ],
    }
    per_turn = summarise(rows)
    assert per_turn["memory"][1]["prefix_hit_tokens"] == 1024
    assert per_turn["memory"][1]["sentences_not_resent"] == 7
    assert per_turn["today"][0]["retention"] == 0.5
    assert per_turn["today"][0]["ttft_p50_ms"] == 200.0
    assert per_turn["memory"][1]["uncached_tokens_mean"] == 776.0
    summary = totals(per_turn)
    assert summary["memory"]["prefix_hit_tokens"] == 1040
    assert summary["today"]["ttft_p95_ms_turns_2_plus"] == 390.0  # over turn 2's requests
    assert summary["today"]["worst_turn_ttft_p95_ms"] == 390.0
    assert summary["memory"]["retention"] == 1.0
    text = render_markdown(
        {
            "policy": "rag-default",
            "dataset": "d",
            "conversations": 2,
            "turns": 2,
            "max_input_tokens": 3072,
            "max_tokens": 8,
            "cpu_path": "x",
            "per_turn": per_turn,
            "totals": summary,
        }
    )
    assert "| memory | 2 | 1024 |" in text
