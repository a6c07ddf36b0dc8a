"""Passage rerankers behind one interface, chosen by `policy.rerank.method`.

- embedding: cosine between the question and passage embeddings.
- bm25: lexical BM25 (bm25s) over this request's passages.
- embedding-bm25 (default): both, min-max normalized and fused with `bm25_weight`.
- cross-encoder: a sentence-transformers CrossEncoder loaded from a local path.
- llm: the backend model scores log p(question | passage) (see `compression.llm_score`).
"""

from __future__ import annotations

import threading
from typing import Protocol

import numpy as np

from compression.embeddings import Embedder
from compression.state import Passage


class Reranker(Protocol):
    name: str

    def score(self, question: str, passages: list[Passage]) -> np.ndarray: ...


def minmax(scores: np.ndarray) -> np.ndarray:
    if scores.size == 0:
        return scores
    low, high = float(scores.min()), float(scores.max())
    if high - low < 1e-9:
        return np.full_like(scores, 0.5, dtype=np.float64)
    return (scores - low) / (high - low)


def passage_text_for_scoring(passage: Passage) -> str:
    return f"{passage.title}. {passage.body()}" if passage.title else passage.body()


def bm25_scores(query: str, documents: list[str]) -> np.ndarray:
    import bm25s

    if not documents:
        return np.zeros(0)
    corpus_tokens = bm25s.tokenize(documents, stopwords="en", return_ids=False, show_progress=False)
    query_tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
    # Empty documents would make bm25s reject the corpus; give them a placeholder token instead.
    corpus_tokens = [tokens or ["\u2205"] for tokens in corpus_tokens]
    retriever = bm25s.BM25()
    retriever.index(corpus_tokens, show_progress=False)
    known = [token for token in query_tokens if token in retriever.vocab_dict]
    if not known:
        return np.zeros(len(documents))
    return np.asarray(retriever.get_scores(known), dtype=np.float64)


class EmbeddingReranker:
    name = "embedding"

    def __init__(self, embedder: Embedder):
        self.embedder = embedder

    def score(self, question: str, passages: list[Passage]) -> np.ndarray:
        vectors = self.embedder.embed([question] + [passage_text_for_scoring(p) for p in passages])
        return (vectors[1:] @ vectors[0]).astype(np.float64)


class BM25Reranker:
    name = "bm25"

    def score(self, question: str, passages: list[Passage]) -> np.ndarray:
        return bm25_scores(question, [passage_text_for_scoring(p) for p in passages])


class FusedReranker:
    name = "embedding-bm25"

    def __init__(self, embedder: Embedder, bm25_weight: float):
        self.embedding = EmbeddingReranker(embedder)
        self.bm25_weight = bm25_weight

    def score(self, question: str, passages: list[Passage]) -> np.ndarray:
        semantic = minmax(self.embedding.score(question, passages))
        lexical = minmax(BM25Reranker().score(question, passages))
        return (1 - self.bm25_weight) * semantic + self.bm25_weight * lexical


_cross_encoders: dict[str, object] = {}
_cross_encoder_lock = threading.Lock()


class CrossEncoderReranker:
    name = "cross-encoder"

    def __init__(self, model_path: str):
        from pathlib import Path

        if not Path(model_path).is_dir():
            raise ValueError(f"rerank.cross_encoder_path {model_path!r} is not a local model directory")
        with _cross_encoder_lock:
            if model_path not in _cross_encoders:
                from sentence_transformers import CrossEncoder

                _cross_encoders[model_path] = CrossEncoder(model_path, device="cpu", local_files_only=True)
        self.model = _cross_encoders[model_path]

    def score(self, question: str, passages: list[Passage]) -> np.ndarray:
        if not passages:
            return np.zeros(0)
        pairs = [(question, passage_text_for_scoring(p)) for p in passages]
        return np.asarray(self.model.predict(pairs, show_progress_bar=False), dtype=np.float64).reshape(-1)
