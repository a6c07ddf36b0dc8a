"""The LLM as a reranker: score each passage by log p(question | passage) under the backend model.

The EngineClient protocol has no scoring call, so this runs a direct forward pass of the same
model (Hugging Face implementation, loaded from the backend model directory) in batches. Scores are
the mean log-probability per question token, so long and short questions compare fairly.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from ctxgate.compression.counting import ChatTokenizer
from ctxgate.compression.state import Passage

PROMPT_TEMPLATE = "Document: {passage}\nA question this document answers: "

_models: dict[str, Any] = {}
_lock = threading.Lock()


class LLMReranker:
    name = "llm"

    def __init__(self, model_dir: str | Path, batch_size: int = 8, max_passage_tokens: int = 256):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        key = str(model_dir)
        with _lock:
            if key not in _models:
                model = AutoModelForCausalLM.from_pretrained(key, local_files_only=True)
                model.eval()
                _models[key] = (model, AutoTokenizer.from_pretrained(key, local_files_only=True))
        self.model, self.tokenizer = _models[key]
        self.batch_size = batch_size
        self.max_passage_tokens = max_passage_tokens

    @classmethod
    def from_tokenizer(cls, tokenizer: ChatTokenizer) -> LLMReranker:
        model_dir = tokenizer.model_dir
        if model_dir is None:
            raise ValueError(
                "rerank.method 'llm' needs the built-in backend model (its tokenizer has no model_dir)"
            )
        return cls(model_dir)

    def score(self, question: str, passages: list[Passage]) -> np.ndarray:
        import torch

        question_ids = self.tokenizer.encode(question, add_special_tokens=False)
        scores: list[float] = []
        for start in range(0, len(passages), self.batch_size):
            batch = passages[start : start + self.batch_size]
            sequences = []
            for passage in batch:
                text = f"{passage.title}. {passage.body()}" if passage.title else passage.body()
                passage_ids = self.tokenizer.encode(text, add_special_tokens=False)[: self.max_passage_tokens]
                prefix = self.tokenizer.encode(
                    PROMPT_TEMPLATE.format(passage=self.tokenizer.decode(passage_ids)),
                    add_special_tokens=False,
                )
                sequences.append((prefix, prefix + question_ids))
            width = max(len(ids) for _, ids in sequences)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
            attention = torch.zeros((len(sequences), width), dtype=torch.long)
            for row, (_, ids) in enumerate(sequences):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention[row, : len(ids)] = 1
            with torch.inference_mode():
                logits = self.model(input_ids=input_ids, attention_mask=attention).logits
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            for row, (prefix, ids) in enumerate(sequences):
                positions = torch.arange(len(prefix) - 1, len(ids) - 1)
                targets = torch.tensor(ids[len(prefix) :])
                scores.append(float(log_probs[row, positions, targets].mean()))
        return np.asarray(scores, dtype=np.float64)
