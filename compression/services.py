"""What the stages share across requests: token counting, caches, models, and the cost estimate.

Heavy helpers (the embedding model, the LLM reranker) are created on first use.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ctxgate.compression.conversation import ConversationMemory
from ctxgate.compression.counting import CachedCounter, ChatTokenizer
from ctxgate.compression.history import HistorySummarizer, SummaryEngine
from ctxgate.compression.store.cache import BytesCache
from ctxgate.compression.store.index import IndexStore

if TYPE_CHECKING:
    from ctxgate.compression.embedding.embeddings import Embedder, Runner
    from ctxgate.compression.llm_score import LLMReranker


class PrefillCostEstimator:
    """Milliseconds of prefill per prompt token, fed from the engine's own request metrics.

    An exponentially weighted average, so it follows load changes; also tracks how long
    compression itself takes, since a cut that costs more than it saves does not pay.
    """

    def __init__(self, ms_per_token: float = 0.5, smoothing: float = 0.1):
        self.ms_per_token = ms_per_token
        self.compression_ms = 0.0
        self.smoothing = smoothing
        self._lock = threading.Lock()

    def observe_prefill(self, prompt_tokens: int, prefill_ms: float) -> None:
        if prompt_tokens <= 0 or prefill_ms <= 0:
            return
        with self._lock:
            sample = prefill_ms / prompt_tokens
            self.ms_per_token += self.smoothing * (sample - self.ms_per_token)

    def observe_compression(self, compression_ms: float) -> None:
        with self._lock:
            self.compression_ms += self.smoothing * (compression_ms - self.compression_ms)

    def net_saving_ms(self, saved_tokens: int) -> float:
        return saved_tokens * self.ms_per_token - self.compression_ms


class Services:
    """Shared, lazily created helpers (the embedding model loads on first use)."""

    def __init__(
        self,
        counter: CachedCounter,
        tokenizer: ChatTokenizer,
        engine: SummaryEngine | None,
        cache: BytesCache,
        index_dir: str | Path | None,
        cost_estimator: PrefillCostEstimator,
    ):
        from ctxgate.compression.text import default_splitter

        self.counter = counter
        self.tokenizer = tokenizer
        self.engine = engine
        self.cache = cache
        self.cost_estimator = cost_estimator
        self.splitter = default_splitter()
        self.index_store = IndexStore(index_dir)
        self.summarizer = HistorySummarizer(counter.count, self.splitter.split, cache, engine, tokenizer)
        self.conversations = ConversationMemory(cache)  # in the same store as the summaries
        self._embedder: Embedder | None = None
        # (window ms, OpenMP threads) of the embedding micro-batcher; None: encode in the caller.
        self.embed_batching: tuple[float, int] | None = None
        # Run the embedding model in a child process (compression/embedding/embed_process.py).
        self.embed_process = False
        # Run the model's forward passes through this (the in-process engine's run_between_steps).
        self.embed_runner: Runner | None = None
        self._llm_reranker: LLMReranker | None = None
        self._lock = threading.Lock()

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            with self._lock:
                if self._embedder is None:
                    from ctxgate.compression.embedding.embeddings import shared_embedder

                    embedder = shared_embedder(self.cache)
                    if self.embed_runner is not None:
                        embedder.use_runner(self.embed_runner)
                    elif self.embed_process:
                        embedder.use_process(self.embed_batching[1] if self.embed_batching else 1)
                    if self.embed_batching is not None:
                        embedder.use_batcher(*self.embed_batching)
                    self._embedder = embedder
        return self._embedder

    def release(self) -> None:
        """Hand the shared embedding model back from this pipeline's engine (it is shutting down)."""
        if self._embedder is not None and self.embed_runner is not None:
            self._embedder.release_runner(self.embed_runner)

    def llm_reranker(self) -> LLMReranker:
        if self._llm_reranker is None:
            from ctxgate.compression.llm_score import LLMReranker

            self._llm_reranker = LLMReranker.from_tokenizer(self.tokenizer)
        return self._llm_reranker
