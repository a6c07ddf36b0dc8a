"""Dataset loading: the shipped files parse, and malformed files fail with file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxgate.eval.datasets import DatasetError, load_dataset, resolve_dataset_path


def _write(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_shipped_datasets_load_with_gold_labels():
    nq = load_dataset(resolve_dataset_path("nq-multidoc-dev.jsonl"))
    assert len(nq.examples) == 300
    first = nq.examples[0]
    assert len(first.passages) == 20 and len(first.gold_passages) == 1
    assert first.documents()[0].keys() == {"id", "title", "text"}
    hotpot = load_dataset(resolve_dataset_path("hotpotqa-distractor-dev.jsonl"), limit=50)
    assert len(hotpot.examples) == 50
    assert any(
        example.is_yes_no
        for example in load_dataset(resolve_dataset_path("hotpotqa-distractor-dev.jsonl")).examples
    )
    assert any(example.supporting_sentences for example in hotpot.examples)


def test_limit_keeps_file_order(tmp_path):
    path = _write(
        tmp_path / "d.jsonl",
        [
            {"id": f"q{i}", "question": f"question {i}?", "answers": ["x"], "passages": [{"text": "x"}]}
            for i in range(4)
        ],
    )
    dataset = load_dataset(path, limit=2)
    assert [example.id for example in dataset.examples] == ["q0", "q1"]
    assert len(dataset.sha256) == 64


def test_minimal_records_without_optional_fields(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"question": "q?", "answers": ["a"], "passages": ["plain text"]}])
    example = load_dataset(path).examples[0]
    assert example.id == "line-1" and example.passages[0].text == "plain text"
    assert example.gold_passages == []


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("{not json", "invalid JSON"),
        ({"answers": ["a"], "passages": []}, "missing field 'question'"),
        ({"question": "q", "answers": "a", "passages": []}, "field 'answers' must be list"),
        ({"question": "q", "answers": [], "passages": []}, "non-empty list"),
        ({"question": "q", "answers": ["a"], "passages": [{"title": "t"}]}, "missing field 'text'"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, record, message):
    good = {"question": "q", "answers": ["a"], "passages": []}
    path = _write(tmp_path / "bad.jsonl", [good, record])
    with pytest.raises(DatasetError, match=message) as info:
        load_dataset(path)
    assert "bad.jsonl:2" in str(info.value)


def test_missing_file_and_bad_limit(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_dataset(tmp_path / "nope.jsonl")
    path = _write(tmp_path / "d.jsonl", [{"question": "q", "answers": ["a"], "passages": []}])
    with pytest.raises(DatasetError, match="--limit"):
        load_dataset(path, limit=0)
