"""Retrieval indexes: build (chunk, embed, FAISS) and search.

On disk, `<index_dir>/<name>/` holds:
- `index.faiss`: inner-product FAISS index over L2-normalized chunk embeddings (cosine),
- `chunks.jsonl`: one chunk per line (`id`, `doc_id`, `title`, `text`, `sentences`),
- `sentence_embeddings.npy` + `chunk_sentence_offsets.npy`: every chunk's sentence vectors, so
  sentence extraction over retrieved chunks needs no model call,
- `meta.json`: model, dimension, counts, chunking settings.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctxgate.compression.store.index_names import UnknownIndexError, check_index_name
from ctxgate.compression.types import Document

__all__ = ["IndexStore", "UnknownIndexError", "build_index", "index_path"]


def default_index_dir() -> Path:
    return Path(os.environ.get("CTXGATE_INDEX_DIR") or Path.home() / ".cache" / "ctxgate" / "indexes")


def index_path(index_dir: str | Path | None, name: str) -> Path:
    return Path(index_dir or default_index_dir()) / check_index_name(name)


def read_documents(path: str | Path) -> Iterator[dict[str, Any]]:
    """JSONL rows with `text` (required), and optional `id` and `title`."""
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_number}: invalid JSON ({exc.msg})") from exc
            if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
                raise ValueError(f"{path}:{line_number}: each line must be an object with a non-empty 'text'")
            yield row


def chunk_sentences(sentences: list[str], max_words: int) -> list[list[str]]:
    """Greedy grouping of whole sentences into chunks of at most `max_words` words (a longer single
    sentence stays whole)."""
    chunks: list[list[str]] = []
    current: list[str] = []
    current_words = 0
    for sentence in sentences:
        length = len(sentence.split())
        if current and current_words + length > max_words:
            chunks.append(current)
            current, current_words = [], 0
        current.append(sentence)
        current_words += length
    if current:
        chunks.append(current)
    return chunks


def build_index(
    input_path: str | Path,
    name: str,
    index_dir: str | Path | None = None,
    chunk_words: int = 120,
    embedder: Any = None,
    show_progress: bool = True,
) -> Path:
    """Chunk a JSONL corpus, embed its sentences and chunks, and write a FAISS index folder."""
    from ctxgate.compression.embedding.embeddings import shared_embedder

    target = index_path(index_dir, name)  # validates the name before any work
    embedder = embedder or shared_embedder()
    chunks = read_chunks(input_path, chunk_words)
    embedded = embed_chunks(chunks, embedder, f"embedding {name}", show_progress)
    write_index(target, chunks, embedded)
    meta = {
        "name": name,
        "model": str(embedder.model_path.name),
        "dimension": int(embedded.chunk_vectors.shape[1]),
        "chunks": len(chunks),
        "sentences": int(embedded.sentence_offsets[-1]),
        "chunk_words": chunk_words,
    }
    (target / "meta.json").write_text(json.dumps(meta, indent=2))
    return target


def read_chunks(input_path: str | Path, chunk_words: int) -> list[dict[str, Any]]:
    """Each document cut into chunks of whole sentences of about `chunk_words` words."""
    from ctxgate.compression.text import default_splitter

    splitter = default_splitter()
    chunks: list[dict[str, Any]] = []
    for row_number, row in enumerate(read_documents(input_path)):
        doc_id = str(row.get("id", row_number))
        title = row.get("title") if isinstance(row.get("title"), str) else None
        for chunk_number, sentences in enumerate(chunk_sentences(splitter.split(row["text"]), chunk_words)):
            chunks.append(
                {
                    "id": f"{doc_id}#{chunk_number}",
                    "doc_id": doc_id,
                    "title": title,
                    "text": " ".join(sentences),
                    "sentences": sentences,
                }
            )
    if not chunks:
        raise ValueError(f"{input_path}: no documents")
    return chunks


@dataclass
class EmbeddedChunks:
    chunk_vectors: np.ndarray  # [chunks, dim] float32, what FAISS searches
    sentence_vectors: np.ndarray  # [sentences, dim] float32, all chunks' sentences in order
    sentence_offsets: np.ndarray  # [chunks + 1] int64: chunk i's sentences are offsets[i]:offsets[i+1]


def embed_chunks(
    chunks: list[dict[str, Any]], embedder: Any, description: str, show_progress: bool, batch: int = 64
) -> EmbeddedChunks:
    from tqdm import tqdm

    from ctxgate.compression.rerank import combine_vectors

    chunk_vectors: list[np.ndarray] = []
    sentence_vectors: list[np.ndarray] = []
    offsets = [0]
    with tqdm(total=len(chunks), desc=description, unit="chunk", disable=not show_progress) as progress:
        for first in range(0, len(chunks), batch):
            part = chunks[first : first + batch]
            sentences = [sentence for chunk in part for sentence in chunk["sentences"]]
            titles = sorted({chunk["title"] for chunk in part if chunk["title"]})
            vectors = embedder.embed(sentences + titles)
            title_vectors = dict(zip(titles, vectors[len(sentences) :], strict=True))
            sentence_vectors.append(vectors[: len(sentences)])
            start = 0
            for chunk in part:
                end = start + len(chunk["sentences"])
                # The same passage vector the rerankers compute (sentences + title), so search
                # scores and rerank scores agree.
                chunk_vectors.append(
                    combine_vectors(vectors[start:end], title_vectors.get(chunk["title"]))[None, :]
                )
                start = end
                offsets.append(offsets[-1] + len(chunk["sentences"]))
            progress.update(len(part))
    return EmbeddedChunks(
        np.concatenate(chunk_vectors).astype(np.float32),
        np.concatenate(sentence_vectors).astype(np.float32),
        np.asarray(offsets, dtype=np.int64),
    )


def write_index(target: Path, chunks: list[dict[str, Any]], embedded: EmbeddedChunks) -> None:
    import faiss

    index = faiss.IndexFlatIP(embedded.chunk_vectors.shape[1])
    index.add(embedded.chunk_vectors)
    target.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index, str(target / "index.faiss"))
    with open(target / "chunks.jsonl", "w", encoding="utf-8") as handle:
        for chunk in chunks:
            handle.write(json.dumps(chunk, ensure_ascii=False) + "\n")
    np.save(target / "sentence_embeddings.npy", embedded.sentence_vectors)
    np.save(target / "chunk_sentence_offsets.npy", embedded.sentence_offsets)


@dataclass
class LoadedIndex:
    name: str
    index: Any
    chunks: list[dict[str, Any]]
    sentence_vectors: np.ndarray
    offsets: np.ndarray

    def search(self, query_vector: np.ndarray, top_n: int) -> list[tuple[int, float]]:
        top_n = max(1, min(top_n, len(self.chunks)))
        scores, ids = self.index.search(query_vector.reshape(1, -1).astype(np.float32), top_n)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]

    def document(self, chunk_id: int, score: float) -> Document:
        chunk = self.chunks[chunk_id]
        return Document(text=chunk["text"], id=chunk["id"], title=chunk.get("title"), score=score)

    def sentences_with_vectors(self, chunk_id: int) -> tuple[list[str], np.ndarray]:
        start, end = int(self.offsets[chunk_id]), int(self.offsets[chunk_id + 1])
        return self.chunks[chunk_id]["sentences"], self.sentence_vectors[start:end]


class IndexStore:
    """Loads indexes on first use and keeps them (they are read-only once built)."""

    def __init__(self, index_dir: str | Path | None = None):
        self.index_dir = Path(index_dir) if index_dir else default_index_dir()
        self._loaded: dict[str, LoadedIndex] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> LoadedIndex:
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
        path = index_path(self.index_dir, name)
        if not (path / "index.faiss").is_file():
            raise UnknownIndexError(f"retrieval index {name!r} not found")
        import faiss

        chunks = [
            json.loads(line)
            for line in (path / "chunks.jsonl").read_text(encoding="utf-8").splitlines()
            if line
        ]
        loaded = LoadedIndex(
            name=name,
            index=faiss.read_index(str(path / "index.faiss")),
            chunks=chunks,
            sentence_vectors=np.load(path / "sentence_embeddings.npy"),
            offsets=np.load(path / "chunk_sentence_offsets.npy"),
        )
        with self._lock:
            self._loaded[name] = loaded
        return loaded
