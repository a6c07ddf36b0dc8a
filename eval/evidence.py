"""Evidence retention: did the context actually sent to the model keep what answers the question?

Computed from the messages the gateway returns from POST /v1/ctxgate/compress (exactly what it
sends), so the check is independent of how the compressor describes its own work.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ctxgate.eval.datasets import EvalExample, Passage
from ctxgate.eval.metrics import answer_in_text, normalize_answer, text_retained


def messages_text(messages: list[dict[str, Any]]) -> str:
    """All text content of chat messages (string contents and text parts of list contents)."""
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "\n".join(parts)


@lru_cache(maxsize=1)
def _segmenter() -> Any:
    import pysbd

    return pysbd.Segmenter(language="en", clean=False)


@lru_cache(maxsize=65536)
def split_sentences(text: str) -> tuple[str, ...]:
    return tuple(sentence.strip() for sentence in _segmenter().segment(text) if sentence.strip())


def passage_sentences(passage: Passage) -> tuple[str, ...]:
    return passage.sentences or split_sentences(passage.text)


def passage_retained(passage: Passage, context_normalized: str) -> bool:
    """A passage counts as kept when at least one of its sentences reached the model verbatim
    (sentence extraction keeps parts of passages; a kept title alone does not count)."""
    return any(text_retained(sentence, context_normalized) for sentence in passage_sentences(passage))


@dataclass
class EvidenceRetention:
    # None where the measure does not apply (yes/no answers; no gold labels in the dataset).
    answer_retained: bool | None
    gold_passages_retained: float | None
    supporting_sentences_retained: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "answer_retained": self.answer_retained,
            "gold_passages_retained": self.gold_passages_retained,
            "supporting_sentences_retained": self.supporting_sentences_retained,
        }


def evidence_retention(example: EvalExample, sent_messages: list[dict[str, Any]]) -> EvidenceRetention:
    context = messages_text(sent_messages)
    context_normalized = normalize_answer(context)
    # "yes"/"no" occur in almost any text: a substring check would always pass.
    answer_retained = None if example.is_yes_no else answer_in_text(context, example.answers)
    gold = example.gold_passages
    gold_share = (
        sum(passage_retained(passage, context_normalized) for passage in gold) / len(gold) if gold else None
    )
    supporting = example.supporting_sentences
    supporting_share = (
        sum(text_retained(sentence, context_normalized) for sentence in supporting) / len(supporting)
        if supporting
        else None
    )
    return EvidenceRetention(answer_retained, gold_share, supporting_share)
