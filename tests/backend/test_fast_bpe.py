"""tiktoken runs the default model's BPE with Hugging Face's exact ids, and anything it cannot
reproduce goes back to Hugging Face."""

from __future__ import annotations

import json
import random

import pytest

from ctxgate.backend.model.fast_bpe import FastBPE

EDGE_CASES = [
    "",
    " ",
    "\n\n",
    "  lead",
    "trail  ",
    "tab\tand\r\nCRLF",
    "'s 'S 'LL 're 've",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_end|><|im_end|>x",
    "x<|endoftext|>y",
    "e\u0301 ñ 中文 🙂 \u200b\u3000\u2028",
    "1234567890 3.14159 -42",
    "x" * 3000,
    "a\x04b",  # a byte outside the vocabulary: Hugging Face drops it
    "\U00041000x",  # so is this lead byte (0xF1)
]


def _hf_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.hf.encode(text, add_special_tokens=False))


def _random_texts(count: int) -> list[str]:
    rng = random.Random(0)
    alphabet = [chr(c) for c in [*range(32, 127), *range(0xA0, 0x250), 0x4E2D, 0x1F642, 0x85, 0x2028]]
    alphabet += ["\n", "\t", " ", "  ", "<|im_start|>", "'s"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120))) for _ in range(count)]


def test_the_default_model_takes_the_fast_path(tokenizer):
    assert tokenizer.fast, "SmolLM2's tokenizer is a GPT-2-style byte-level BPE"


@pytest.mark.parametrize("text", EDGE_CASES)
def test_edge_cases_have_hugging_faces_ids(tokenizer, text):
    assert tokenizer.encode(text) == _hf_ids(tokenizer, text)


def test_random_unicode_and_eval_passages_have_hugging_faces_ids(tokenizer):
    from ctxgate.eval.datasets import load_dataset, resolve_dataset_path

    texts = _random_texts(500)
    for example in load_dataset(resolve_dataset_path("hotpotqa-distractor-dev.jsonl"), limit=20).examples:
        texts += [document["text"] for document in example.documents()]
    mismatched = [text for text in texts if tokenizer.encode(text) != _hf_ids(tokenizer, text)]
    assert mismatched == []
    assert tokenizer.count_many(texts[:50]) == [len(_hf_ids(tokenizer, text)) for text in texts[:50]]


def test_chat_prompts_count_as_the_engine_encodes_them(tokenizer):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Où est Lyon ? 🙂"},
    ]
    rendered = tokenizer.render_chat(messages)
    assert tokenizer.encode_chat(messages) == _hf_ids(tokenizer, rendered)
    assert tokenizer.count_chat(messages) == len(_hf_ids(tokenizer, rendered))


def test_tokenizers_outside_the_supported_shape_keep_hugging_face(tmp_path, model_dir):
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = {"type": "NFC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    assert FastBPE.load(tmp_path / "tokenizer.json", fallback=list) is None
    spec["normalizer"] = None
    first, second = spec["model"]["merges"][:2]
    spec["model"]["merges"][:2] = [second, first]  # merge order no longer follows the ids
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    assert FastBPE.load(tmp_path / "tokenizer.json", fallback=list) is None
    assert FastBPE.load(tmp_path / "missing.json", fallback=list) is None


def test_texts_the_fast_path_cannot_encode_get_hugging_faces_answer(tokenizer):
    assert tokenizer._fast._missing_bytes, "SmolLM2's vocabulary lacks some bytes (0x04, 0xF1, ...)"
    for text in ("a\x04b", "\U00041000x"):  # Hugging Face drops the missing byte
        assert tokenizer.encode(text) == _hf_ids(tokenizer, text)
    with pytest.raises(Exception) as from_hf:
        _hf_ids(tokenizer, "a\ud800b")  # a lone surrogate (the HTTP layer refuses these with a 400)
    with pytest.raises(from_hf.type):
        tokenizer.encode("a\ud800b")
