"""Passage rerankers behind one interface, chosen by `policy.rerank.method`.

- embedding: cosine between the question and passage embeddings.
- bm25: lexical BM25 (bm25s's scoring, computed directly) over this request's passages.
- embedding-bm25 (default): both, min-max normalized and fused with `bm25_weight`.
- cross-encoder: a sentence-transformers CrossEncoder loaded from a local path.
- llm: the backend model scores log p(question | passage) (see `ctxgate.compression.llm_score`).
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter
from functools import lru_cache
from typing import Protocol

import numpy as np

from ctxgate.compression.embedding.embeddings import Embedder
from ctxgate.compression.state import Passage
from ctxgate.compression.store.cache import byte_bounded_cache


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


# BM25 as bm25s scores it by default (Lucene variant, k1 1.5, b 0.75; scikit-learn's word pattern,
# lower-cased, NLTK's English stopwords), computed directly: over one request's 20-odd passages,
# building a bm25s index (vocabulary dicts, sparse matrices) cost ~5 ms a call.
BM25_K1 = 1.5
BM25_B = 0.75
_BM25_WORD = re.compile(r"(?u)\b\w\w+\b")


@lru_cache(maxsize=1)
def _bm25_stopwords() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def bm25_terms(text: str) -> list[str]:
    stopwords = _bm25_stopwords()
    return [word for word in _BM25_WORD.findall(text.lower()) if word not in stopwords]


@byte_bounded_cache(max_entries=8192, budget="bm25")
def bm25_document(text: str) -> tuple[Counter[str], int]:
    """A document's term counts and length. Cached: the pre-filter and the rerank score the same
    passages of a request, so each is tokenized once. The
    Counter is shared: read it, never change it."""
    # An empty document still counts in the collection, as one placeholder term.
    terms = bm25_terms(text) or ["\u2205"]
    return Counter(terms), len(terms)


def bm25_scores(query: str, documents: list[str]) -> np.ndarray:
    """BM25 of each document for `query`, with the documents themselves as the collection (idf)."""
    if not documents:
        return np.zeros(0)
    corpus = [bm25_document(document) for document in documents]
    term_counts = [counts for counts, _ in corpus]
    query_terms = [term for term in bm25_terms(query) if any(term in counts for counts in term_counts)]
    if not query_terms:
        return np.zeros(len(documents))
    num_documents = len(documents)
    lengths = np.array([length for _, length in corpus], dtype=np.float64)
    length_norm = BM25_K1 * ((1 - BM25_B) + BM25_B * lengths / lengths.mean())
    scores = np.zeros(num_documents)
    for term in query_terms:  # a repeated query term counts each time, as in bm25s
        frequencies = np.array([counts.get(term, 0) for counts in term_counts], dtype=np.float64)
        document_frequency = int(np.count_nonzero(frequencies))
        idf = math.log(1 + (num_documents - document_frequency + 0.5) / (document_frequency + 0.5))
        scores += idf * frequencies / (length_norm + frequencies)
    return scores


def live_sentences(passage: Passage) -> list[str]:
    sentences = passage.sentences or [passage.text]
    if passage.kept_sentences is not None:
        indices = sorted(passage.kept_sentences)
    else:
        indices = [i for i in range(len(sentences)) if i not in passage.removed_sentences]
    if passage.embed_sentences is not None:
        # The lexical pre-filter chose which sentences are worth an embedding.
        indices = [i for i in indices if i in passage.embed_sentences]
    return [sentences[i] for i in indices]


def embedded_sentences(passage: Passage) -> list[str]:
    """The texts that stand for a passage in its vector (its title is added separately)."""
    return live_sentences(passage) or ([] if passage.title else [passage.text])


def passage_embedding_texts(passages: list[Passage]) -> list[str]:
    """Every text `passage_vectors` embeds, in one list."""
    return [s for p in passages for s in embedded_sentences(p)] + [p.title for p in passages if p.title]


def combine_vectors(sentence_vectors: np.ndarray, title_vector: np.ndarray | None) -> np.ndarray:
    """A passage's vector: the normalized sum of its sentences' (and its title's) vectors.

    Built from sentence vectors, which extraction needs anyway, so a passage costs one embedding
    pass instead of two (the model call dominates compression time on a cold cache).
    """
    total = sentence_vectors.sum(axis=0) if len(sentence_vectors) else np.zeros(sentence_vectors.shape[1])
    if title_vector is not None:
        total = total + title_vector
    norm = float(np.linalg.norm(total))
    return (total / norm).astype(np.float32) if norm > 0 else total.astype(np.float32)


def passage_vectors(embedder: Embedder, passages: list[Passage]) -> np.ndarray:
    """(len(passages), dim); passages must already be split into sentences."""
    if not passages:
        return np.zeros((0, embedder.dimension), dtype=np.float32)
    per_passage = [embedded_sentences(p) for p in passages]
    titles = [p.title for p in passages if p.title]
    flat = [s for sentences in per_passage for s in sentences]
    vectors = embedder.embed(flat + titles)
    title_vectors = dict(zip(titles, vectors[len(flat) :], strict=True))
    result = []
    start = 0
    for passage, sentences in zip(passages, per_passage, strict=True):
        end = start + len(sentences)
        result.append(
            combine_vectors(vectors[start:end], title_vectors.get(passage.title) if passage.title else None)
        )
        start = end
    return np.stack(result)


class EmbeddingReranker:
    name = "embedding"

    def __init__(self, embedder: Embedder):
        self.embedder = embedder

    def score(self, question: str, passages: list[Passage]) -> np.ndarray:
        question_vector = self.embedder.embed([question])[0]
        return (passage_vectors(self.embedder, passages) @ question_vector).astype(np.float64)


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


# Second stage for untitled passages: this many times the rerank cut is scored again with every
# sentence embedded.
UNTITLED_CANDIDATES_FACTOR = 2


def refine_untitled(
    reranker: Reranker, question: str, passages: list[Passage], scores: np.ndarray, keep: int
) -> np.ndarray:
    """Second rerank stage for passages without a title, for the embedding rerankers.

    A passage's vector is built from the sentences the lexical pre-filter chose to embed (see
    `passage_vectors`); with a title, the title's vector (and the title's words in BM25 and the
    pre-filter) carries the passage's topic. Without one (LangChain's default "{page_content}"
    document prompt drops it) a passage from the article the question is about may share no word with
    the question, so its vector stands on a sentence or two that matched by chance and it falls below
    the cut. The passages near the cut (`UNTITLED_CANDIDATES_FACTOR` x `keep`, by the first scores)
    are therefore scored again among themselves with every sentence of the untitled ones embedded;
    they rank above the rest, which keep their first-stage scores. Passages with titles alone (or a
    cut that keeps every passage) are left as scored."""
    if not isinstance(reranker, (EmbeddingReranker, FusedReranker)) or keep >= len(passages):
        return scores
    order = sorted(range(len(passages)), key=lambda i: (-scores[i], passages[i].position))
    candidates = order[: UNTITLED_CANDIDATES_FACTOR * keep]
    if all(passages[i].title for i in candidates):
        return scores
    for i in candidates:
        if not passages[i].title:
            passages[i].embed_sentences = None  # every sentence: extraction then scores them all too
    refined = minmax(
        np.asarray(reranker.score(question, [passages[i] for i in candidates]), dtype=np.float64)
    )
    # Scores stay on the first stage's scale (a policy's min_score means what it meant): the
    # candidates spread over the range they had, the rest stay below them.
    result = np.asarray(scores, dtype=np.float64).copy()
    low, high = float(result[candidates].min()), float(result[candidates].max())
    others = np.ones(len(passages), dtype=bool)
    others[candidates] = False
    result[others] = np.minimum(result[others], np.nextafter(low, -np.inf))
    result[candidates] = low + max(high - low, 1e-6) * refined
    return result


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
