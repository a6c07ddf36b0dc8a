"""Evidence retention measured on the messages actually sent."""

from __future__ import annotations

from ctxgate.eval.datasets import EvalExample, Passage
from ctxgate.eval.evidence import evidence_retention, messages_text

GOLD = Passage(
    title="Hippo song",
    text="I Want a Hippopotamus for Christmas is a song. It was sung by Gayla Peevey in 1953.",
    is_gold=True,
)
OTHER = Passage(title="Other", text="Santa Claus is a figure. He brings presents.")


def _example(answers=("Gayla Peevey",), supporting=()) -> EvalExample:
    return EvalExample(
        id="q",
        question="who sang it?",
        answers=answers,
        passages=(OTHER, GOLD),
        supporting_sentences=supporting,
    )


def _sent(context: str) -> list[dict]:
    return [
        {"role": "system", "content": "Answer."},
        {"role": "user", "content": f"{context}\n\nwho sang it?"},
    ]


def test_full_context_retains_everything():
    retention = evidence_retention(
        _example(supporting=("It was sung by Gayla Peevey in 1953.",)), _sent(f"{OTHER.text}\n{GOLD.text}")
    )
    assert retention.answer_retained is True
    assert retention.gold_passages_retained == 1.0
    assert retention.supporting_sentences_retained == 1.0


def test_extracted_sentence_counts_but_title_alone_does_not():
    kept_sentence = evidence_retention(_example(), _sent("Hippo song\nIt was sung by Gayla Peevey in 1953."))
    assert kept_sentence.answer_retained and kept_sentence.gold_passages_retained == 1.0
    title_only = evidence_retention(_example(), _sent("Hippo song\nSanta Claus is a figure."))
    assert title_only.answer_retained is False and title_only.gold_passages_retained == 0.0


def test_yes_no_answers_and_unlabelled_data_are_not_scored():
    retention = evidence_retention(_example(answers=("yes",)), _sent("yes, no, maybe"))
    assert retention.answer_retained is None
    unlabelled = EvalExample(id="u", question="q", answers=("x",), passages=(OTHER,))
    assert evidence_retention(unlabelled, _sent("x")).gold_passages_retained is None


def test_messages_text_reads_list_contents():
    text = messages_text(
        [{"role": "user", "content": [{"type": "text", "text": "alpha"}, {"type": "text", "text": "beta"}]}]
    )
    assert "alpha" in text and "beta" in text
