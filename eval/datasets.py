"""QA datasets for the eval: JSON Lines with `question`, `answers` and `passages` per line.

The shipped files (../shared/data/eval/) carry extra labels (`is_gold` per passage, optional
`supporting_sentences`, `meta`); any JSONL with the three required fields works. `meta` is never
sent to the model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Answers that a substring check of the context cannot verify (HotpotQA comparison questions).
YES_NO_ANSWERS = frozenset({"yes", "no"})


@dataclass(frozen=True)
class Passage:
    text: str
    title: str = ""
    is_gold: bool = False
    sentences: tuple[str, ...] = ()


@dataclass(frozen=True)
class EvalExample:
    id: str
    question: str
    answers: tuple[str, ...]
    passages: tuple[Passage, ...]
    supporting_sentences: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_yes_no(self) -> bool:
        return all(answer.strip().lower() in YES_NO_ANSWERS for answer in self.answers)

    @property
    def gold_passages(self) -> list[Passage]:
        return [passage for passage in self.passages if passage.is_gold]

    def documents(self) -> list[dict[str, str]]:
        """The passages as the gateway's `ctxgate.documents` (ids are positions, so results can
        name which passages survived)."""
        return [
            {"id": f"p{index}", "title": passage.title, "text": passage.text}
            for index, passage in enumerate(self.passages)
        ]


@dataclass(frozen=True)
class Dataset:
    path: str
    examples: list[EvalExample]
    sha256: str

    @property
    def name(self) -> str:
        return Path(self.path).stem


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file, line and field."""


def _require(record: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in record:
        raise DatasetError(f"{where}: missing field '{key}'")
    value = record[key]
    if not isinstance(value, kind):
        raise DatasetError(f"{where}: field '{key}' must be {kind.__name__}, got {type(value).__name__}")
    return value


def _parse_passage(raw: Any, where: str) -> Passage:
    if isinstance(raw, str):
        return Passage(text=raw)
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: a passage must be an object or a string")
    text = _require(raw, "text", str, where)
    sentences = raw.get("sentences") or ()
    return Passage(
        text=text,
        title=str(raw.get("title") or ""),
        is_gold=bool(raw.get("is_gold", False)),
        sentences=tuple(str(sentence) for sentence in sentences),
    )


def parse_example(record: Any, where: str, fallback_id: str) -> EvalExample:
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: each line must be a JSON object")
    question = _require(record, "question", str, where)
    if not question.strip():
        raise DatasetError(f"{where}: field 'question' is empty")
    answers = _require(record, "answers", list, where)
    if not answers or not all(isinstance(answer, str) and answer.strip() for answer in answers):
        raise DatasetError(f"{where}: field 'answers' must be a non-empty list of non-empty strings")
    raw_passages = _require(record, "passages", list, where)
    passages = tuple(
        _parse_passage(raw, f"{where} passage {index}") for index, raw in enumerate(raw_passages)
    )
    supporting = record.get("supporting_sentences") or []
    supporting_texts = tuple(
        str(item["text"]) if isinstance(item, dict) else str(item) for item in supporting
    )
    return EvalExample(
        id=str(record.get("id") or fallback_id),
        question=question,
        answers=tuple(answers),
        passages=passages,
        supporting_sentences=supporting_texts,
        meta=dict(record.get("meta") or {}),
    )


def load_dataset(path: str | Path, limit: int | None = None) -> Dataset:
    """Read a JSONL dataset; `limit` keeps the first N questions (file order, deterministic)."""
    file_path = Path(path)
    if not file_path.is_file():
        raise FileNotFoundError(f"dataset not found: {file_path}")
    if limit is not None and limit <= 0:
        raise DatasetError("--limit must be a positive integer")
    raw_bytes = file_path.read_bytes()
    examples: list[EvalExample] = []
    seen_ids: set[str] = set()
    for line_number, line in enumerate(raw_bytes.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file_path}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: invalid JSON ({exc.msg})") from exc
        example = parse_example(record, where, fallback_id=f"line-{line_number}")
        if example.id in seen_ids:
            raise DatasetError(f"{where}: duplicate id '{example.id}'")
        seen_ids.add(example.id)
        examples.append(example)
        if limit is not None and len(examples) >= limit:
            break
    if not examples:
        raise DatasetError(f"{file_path}: no questions")
    return Dataset(path=str(file_path), examples=examples, sha256=hashlib.sha256(raw_bytes).hexdigest())


def resolve_dataset_path(name_or_path: str | Path) -> Path:
    """A path as given, or a bare file name looked up in the shared data dir (`shared/data/eval` in
    the repository's parent directories, e.g. ../shared/data/eval)."""
    candidate = Path(name_or_path)
    if candidate.exists() or candidate.is_absolute() or len(candidate.parts) > 1:
        return candidate
    for parent in Path(__file__).resolve().parents:
        shared = parent / "shared" / "data" / "eval" / candidate
        if shared.is_file():
            return shared
    return candidate
