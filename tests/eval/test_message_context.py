"""`ctxgate eval message-context`: LangChain-rendered prompts through /v1/ctxgate/compress."""

from __future__ import annotations

import json
from pathlib import Path

from ctxgate.cli import main

FILLER = " ".join(
    f"Sentence {k} about rivers: rivers shape the land in region {k} over many years." for k in range(40)
)


def _dataset(tmp_path: Path) -> Path:
    """Two questions whose answer sits in one of eight long passages (a real cut at rag-default)."""
    rows = []
    for index, (question, answer, fact) in enumerate(
        [
            (
                "When was the Eiffel Tower completed?",
                "1889",
                "The Eiffel Tower was completed in 1889 for the fair.",
            ),
            ("Who wrote Hamlet?", "Shakespeare", "Hamlet is a tragedy written by William Shakespeare."),
        ]
    ):
        passages = [{"title": f"Rivers {k}", "text": FILLER} for k in range(8)]
        passages[3] = {"title": "Fact", "text": fact + " " + FILLER}
        rows.append({"id": f"q{index}", "question": question, "answers": [answer], "passages": passages})
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_message_context_cuts_langchain_prompts_within_budget(tmp_path, model_dir, capsys):
    dataset = _dataset(tmp_path)
    code = main(["eval", "message-context", "--input", str(dataset), "--limit", "2"])
    result = json.loads(capsys.readouterr().out)
    assert code == (0 if result["passed"] else 1)
    assert result["requests"] == 2 and result["refused"] == 0 and result["over_budget"] == 0
    # reduction is rounded to 2 decimals: original / sent is within 0.005 of it
    sent, original = result["sent_tokens"], result["original_tokens"]
    assert sent < original and abs(original - sent * result["reduction"]) <= sent * 0.005 + 1
    assert result["answerable"] == 2 and result["passages_found_mean"] >= 8
    # --offset skips questions: one left
    code = main(["eval", "message-context", "--input", str(dataset), "--offset", "1", "--limit", "5"])
    assert json.loads(capsys.readouterr().out)["requests"] == 1


def test_message_context_refuses_bad_arguments(tmp_path, capsys):
    assert main(["eval", "message-context", "--input", str(tmp_path / "missing.jsonl"), "--limit", "1"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["eval", "message-context", "--input", str(tmp_path / "x.jsonl"), "--offset", "-1"]) == 2
    assert "--offset" in capsys.readouterr().err
